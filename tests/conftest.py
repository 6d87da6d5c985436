"""Shared fixtures: a prepared copy of the bundled corpus (small vocabulary), offline settings, and Triton's
interpreter on a machine without CUDA."""

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The interpreter runs lm's Triton kernels on the CPU (tests/test_op_mesa_triton.py). Triton reads this when it is
# first imported, by whichever test imports it first, so it is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def kjv_data(tmp_path_factory) -> str:
    """The bundled KJV corpus prepared with a 512-token BPE (about 1.7M training tokens)."""
    from lm.data_prep.prepare import BUNDLED_CORPUS, prepare

    out = tmp_path_factory.mktemp("kjv") / "data"
    prepare([str(BUNDLED_CORPUS)], str(out), vocab_size=512, progress=False)
    return str(out)


@pytest.fixture(scope="session")
def strategy_runs(kjv_data, tmp_path_factory) -> dict:
    """4 steps of every strategy on 2 processes, and of one process (tests/strategy_runs.py): made once, for
    tests/test_scale_out.py and for tests/test_slurm.py's 2-node runs."""
    from strategy_runs import train_every_strategy

    return train_every_strategy(tmp_path_factory.mktemp("scale_out"), kjv_data)

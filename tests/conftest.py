"""Shared fixtures: a prepared copy of the bundled corpus (small vocabulary) and offline settings."""

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def kjv_data(tmp_path_factory) -> str:
    """The bundled KJV corpus prepared with a 512-token BPE (about 1.7M training tokens)."""
    from data_prep.prepare import BUNDLED_CORPUS, prepare

    out = tmp_path_factory.mktemp("kjv") / "data"
    prepare([str(BUNDLED_CORPUS)], str(out), vocab_size=512, progress=False)
    return str(out)

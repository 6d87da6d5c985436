"""lm.training.console: Lightning's banners and tips and the known deprecation warnings are dropped, by logger and exact
text, while other messages and warnings of the same loggers and categories still show. (A real run's console:
tests/test_progress.py and tests/test_demo.py.) What `lm train` says first (the parameters and each layer's mixer), a
command's stdout that holds its result alone (libraries' notices on stderr), and a run's files under the user's
umask."""

import contextlib
import io
import json
import logging
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info as fabric_info
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lm.training.console import DropMessages, quiet_known_noise


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_banners_go_and_the_rest_of_the_same_loggers_stays():
    quiet_known_noise()
    quiet_known_noise()  # idempotent: one filter per logger
    loggers = ["lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero", "DeepSpeed"]
    assert all(sum(isinstance(f, DropMessages) for f in logging.getLogger(name).filters) == 1 for name in loggers)
    records = Records()
    for name in loggers:
        logging.getLogger(name).addHandler(records)
    try:
        rank_zero_info("GPU available: False, used: False")
        rank_zero_info("TPU available: False, using: 0 TPU cores")
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        fabric_info("GPU available: True (cuda), used: True")
        rank_zero_info("`Trainer.fit` stopped: `max_steps=4` reached.")
        logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU or other accelerator, we "
                                               "were unable to detect it.")
        rank_zero_info("`Trainer.fit` stopped: No training batches.")  # a real problem
        rank_zero_info("GPU available but not used. You can set it by doing `Trainer(accelerator='gpu')`.")
        logging.getLogger("DeepSpeed").warning("a DeepSpeed warning")
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(records)
    assert records.messages == ["`Trainer.fit` stopped: No training batches.",
                                "GPU available but not used. You can set it by doing `Trainer(accelerator='gpu')`.",
                                "a DeepSpeed warning"]


def test_the_known_deprecation_goes_and_other_warnings_stay():
    from lightning.pytorch.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_noise()
        _tree_flatten(1)  # Lightning's helper builds torch's deprecated LeafSpec
        warnings.warn("`isinstance(x, Other)` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("a real warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`isinstance(x, Other)` is deprecated", "a real warning"]


def test_without_the_filters_the_deprecation_is_there():
    """The message the filter matches is the one torch gives (a torch that changes it makes this fail)."""
    from lightning.pytorch.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tree_flatten(1)
    assert any("`isinstance(treespec, LeafSpec)` is deprecated" in str(w.message) for w in caught)


THREE_TO_ONE = "gated_deltanet,gated_deltanet,gated_deltanet,attention"
UMASK = 0o027  # the run's: neither the usual 022 nor what a library's private temporary file has (0600)


@pytest.fixture(scope="module")
def hybrid_run(kjv_data, tmp_path_factory) -> tuple[Path, list[str]]:
    """One optimizer step and a checkpoint of a 3:1 hybrid, by `lm train` in this process under UMASK: its run
    directory and the lines it wrote on stderr."""
    from lm.cli import main

    folder = tmp_path_factory.mktemp("console")
    config = folder / "hybrid.yaml"
    config.write_text(f"""
run_dir: {folder / "run"}
model: {{vocab_size: 512, d_model: 32, n_layers: 4, n_heads: 2, head_dim: 16, max_seq_len: 32,
        layer_pattern: "{THREE_TO_ONE}"}}
data: {{path: {kjv_data}, seq_len: 32, micro_batch: 2, num_workers: 0, val_windows: 2}}
strategy: {{accelerator: cpu}}
trainer: {{max_steps: 1, val_every: 1, ckpt_every: 1, log_every: 1, progress_bar: false}}
""")
    err, previous = io.StringIO(), os.umask(UMASK)
    try:
        with contextlib.redirect_stderr(err):
            assert main(["train", "--config", str(config)]) == 0
    finally:
        os.umask(previous)
    return folder / "run", err.getvalue().splitlines()


def test_lm_train_starts_by_saying_the_parameter_count_and_each_layers_mixer(hybrid_run):
    """The count is the checkpoint's: every tensor it holds is a parameter (the tied head is stored once)."""
    run, err = hybrid_run
    (checkpoint,) = (run / "checkpoints").glob("step=*.ckpt")
    weights = torch.load(checkpoint, weights_only=True)["state_dict"]
    count = sum(tensor.numel() for tensor in weights.values())
    said = [line for line in err if line.startswith("lm train: ")]
    assert said[0] == f"lm train: {count:,} parameters; 4 layers: gated_deltanet x3, attention x1", err


def test_deepspeeds_log_goes_to_stderr_in_any_process():
    """DeepSpeed logs through a handler of its own on stdout, at import too ("Setting accelerator to CPU"): the
    start-up hook that installing lm adds (lm/startup.py) sends it to stderr in every process of this environment,
    lm's commands and lm_eval's alike, and drops that CPU notice (a one-line error stays one line)."""
    code = "import logging, deepspeed; logging.getLogger('DeepSpeed').warning('a DeepSpeed warning')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "" and "a DeepSpeed warning" in done.stderr
    assert "Setting accelerator to CPU" not in done.stderr


def test_a_commands_stdout_is_its_result_alone(hybrid_run, tmp_path, capfd):
    """`lm eval ppl`'s stdout is its JSON, `lm generate`'s the text, and `lm export` writes files, so its stdout is
    empty and its one line saying where is on stderr (fds 1 and 2 captured, libraries' writes included); a fresh
    process's DeepSpeed notice: the test above."""
    from lm.cli import main
    from lm.generate import generate_text

    run, _ = hybrid_run
    (checkpoint,) = (run / "checkpoints").glob("step=*.ckpt")
    assert main(["eval", "ppl", "--checkpoint", str(run), "--max_windows", "2", "--out", str(tmp_path / "ppl")]) == 0
    result = json.loads(capfd.readouterr().out)
    assert math.isclose(result["ppl"], math.exp(result["loss"]), rel_tol=1e-6)
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    written = capfd.readouterr()
    assert written.out == "" and f"exported {checkpoint} -> {tmp_path / 'hf'} (hf format)" in written.err.splitlines()
    prompt = ["--prompt", "In the", "--max_new_tokens", "4", "--temperature", "0"]
    assert main(["generate", "--checkpoint", str(run), *prompt]) == 0
    assert capfd.readouterr().out == generate_text(str(run), "In the", max_new_tokens=4, temperature=0) + "\n"


def test_a_runs_files_take_the_users_umask(hybrid_run):
    """Every file and folder `lm train` wrote (config, tokenizer, metrics, the checkpoint and its manifest) has the
    mode that open() and mkdir() give under the run's umask."""
    run, _ = hybrid_run
    modes = {path.relative_to(run).as_posix(): oct(path.stat().st_mode & 0o777) for path in run.rglob("*")}
    assert {"config.yaml", "tokenizer.json", "checkpoints"} <= set(modes) and len(modes) > 5
    assert modes == {name: oct((0o777 if (run / name).is_dir() else 0o666) & ~UMASK) for name in modes}


def test_a_resume_says_so_once_and_lightnings_banners_stay_off(kjv_data, tmp_path):
    """A real resume (of a finished run, from its last checkpoint): `lm train` says which checkpoint it continues, and
    Lightning's "Checkpoint directory ... exists and is not empty", "Restoring states from the checkpoint path ..."
    and "Restored all states ..." do not show, in its log records or warnings."""
    from strategy_runs import train_here
    from test_train import config_file

    run = tmp_path / "run"
    config = config_file(tmp_path, kjv_data, run, max_steps=2, ckpt_every=2, val_every=2)
    assert train_here(config, run).returncode == 0
    records = Records()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch.utilities.rank_zero",
                                                    "lightning.fabric.utilities.rank_zero")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = train_here(config, run)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"lm train: resuming from {run / 'checkpoints' / 'step=00000002.ckpt'}" in resumed.stderr.splitlines()
    said = [*records.messages, *(str(w.message) for w in caught), *resumed.stderr.splitlines()]
    banners = ("exists and is not empty", "Restoring states from", "Restored all states")
    assert not [line for line in said if any(banner in line for banner in banners)], said

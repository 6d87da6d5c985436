"""`lm train` with strategy.context_parallel 2 (DDP on 2 gloo processes sharing each window, in float64) against the
same run on one process: the same loss at every step and the same weights; a stop notice checkpoints, and the run
resumes exactly, with context parallelism or without it (a change of N continues)."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from strategy_runs import environment, lm_command, train
from test_scale_out import exported, last_launch_losses, losses

from lm.cli import main
from lm.compare.run_results import read_run
from lm.training.checkpoint import step_checkpoints
from lm.training.stop_request import STOPPED_EXIT_CODE

CONTEXT_PARALLEL = ["--strategy.name", "ddp", "--strategy.devices", "2", "--strategy.context_parallel", "2"]


def config(tmp: Path, data: str) -> Path:
    # A hybrid: a recurrence whose state crosses the ranks (Gated DeltaNet, with its convolutions) and attention
    # (its keys and values, and their rotary positions).
    path = tmp / "cp.yaml"
    path.write_text(f"""
seed: 5
model: {{vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 2, head_dim: 16, max_seq_len: 32,
         layer_pattern: "gated_deltanet,attention", mixer_options: {{gated_deltanet: {{chunk_size: 8}}}}}}
data: {{path: {data}, seq_len: 32, micro_batch: 2, global_batch: 2, num_workers: 0, val_windows: 4}}
optim: {{lr: 1.0e-2, warmup_steps: 1}}
trainer: {{max_steps: 4, val_every: 2, ckpt_every: 2, keep_last: 3, log_every: 1, progress_bar: false}}
strategy: {{accelerator: cpu, precision: 64-true}}
""")
    return path


@pytest.fixture(scope="module")
def runs(kjv_data, tmp_path_factory) -> dict[str, Path]:
    """The run on one process; the same on 2 processes sharing each window, stopped by a notice during step 2 (it
    checkpoints at the step's end), then resumed to the end."""
    tmp = tmp_path_factory.mktemp("context_parallel")
    cfg = config(tmp, kjv_data)
    train(cfg, tmp / "single")
    stopped = subprocess.run(lm_command("train", "--config", str(cfg), "--run_dir", str(tmp / "cp"), *CONTEXT_PARALLEL),
                             env={**environment(), "LM_FAULTS": "signal@step:1"}, capture_output=True, text=True,
                             timeout=600)
    checkpoints = [p.name for p in step_checkpoints(tmp / "cp" / "checkpoints")]
    shutil.copytree(tmp / "cp", tmp / "cp-then-one")
    resumed = train(cfg, tmp / "cp", *CONTEXT_PARALLEL)
    train(cfg, tmp / "cp-then-one")
    return {"single": tmp / "single", "cp": tmp / "cp", "cp-then-one": tmp / "cp-then-one", "stopped": stopped,
            "checkpoints": checkpoints, "resumed": resumed}


def test_context_parallel_training_is_one_process_step_for_step(runs, tmp_path):
    assert "context parallel: 2 processes share each window" in runs["resumed"].stderr
    single, cp = losses(runs["single"]), losses(runs["cp"])
    assert len(cp) == 4
    assert cp == pytest.approx(single, rel=1e-10, abs=0)
    a, b = exported(runs["single"], tmp_path / "a"), exported(runs["cp"], tmp_path / "b")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-10) for k in a)
    # Validation: each group scores its replica's windows by pieces; the mean is one process's loss.
    assert read_run(str(runs["cp"])).val_loss == pytest.approx(read_run(str(runs["single"])).val_loss, rel=1e-10)
    # The compute charged: the group spends each window's FLOPs once, between its ranks.
    assert read_run(str(runs["cp"])).spent == pytest.approx(read_run(str(runs["single"])).spent, rel=1e-12)


def test_context_parallel_training_stops_on_notice_and_resumes_exactly(runs):
    assert runs["stopped"].returncode == STOPPED_EXIT_CODE, runs["stopped"].stderr[-2000:]
    assert runs["checkpoints"] == ["step=00000002.ckpt"]
    assert "resuming from" in runs["resumed"].stderr
    for resumed in (runs["cp"], runs["cp-then-one"]):
        after = last_launch_losses(resumed)
        assert sorted(after) == [3, 4] and [after[3], after[4]] == pytest.approx(losses(runs["single"])[2:], rel=1e-10)


def test_a_context_parallel_size_that_does_not_divide_is_one_line(kjv_data, tmp_path, capsys):
    code = main(["train", "--config", str(config(tmp_path, kjv_data)), "--run_dir", str(tmp_path / "run"),
                 "--strategy.name", "ddp", "--strategy.devices", "2", "--strategy.context_parallel", "4"])
    assert code == 2
    assert "strategy.context_parallel 4 does not divide the 2 processes" in capsys.readouterr().err

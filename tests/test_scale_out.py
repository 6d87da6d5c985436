"""Real 2-process CPU runs (gloo) of DDP, DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 against one process with the same
global batch: same losses, exports that load with identical logits, exact resumes, a graceful stop on SIGUSR1,
and damaged checkpoints refused."""

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lm.batch import global_batch_of, resolve_accumulation
from lm.checkpoint import checkpoint_problem, step_checkpoints
from lm.cli import main
from lm.errors import UserError
from lm.model import LanguageModel
from lm.stop_request import STOPPED_EXIT_CODE

STRATEGIES = {
    "ddp": ["--strategy.name", "ddp", "--strategy.devices", "2"],
    "zero2": ["--strategy.name", "deepspeed", "--strategy.zero_stage", "2", "--strategy.devices", "2"],
    "zero3": ["--strategy.name", "deepspeed", "--strategy.zero_stage", "3", "--strategy.devices", "2"],
    "fsdp2": ["--strategy.name", "fsdp", "--strategy.devices", "2"],
}
ONE_PROCESS = ["--data.micro_batch", "4"]  # the same global batch of 4 sequences as 2 processes x 2


def base_config(tmp: Path, data: str, steps: int = 4, ckpt_every: int = 2) -> Path:
    path = tmp / "base.yaml"
    path.write_text(f"""
seed: 3
model: {{vocab_size: 512, d_model: 64, n_layers: 2, n_heads: 2, head_dim: 32, max_seq_len: 64}}
data: {{path: {data}, seq_len: 64, micro_batch: 2, global_batch: 4, num_workers: 0, val_windows: 8}}
optim: {{lr: 3.0e-3, warmup_steps: 2}}
trainer: {{max_steps: {steps}, val_every: 1000, ckpt_every: {ckpt_every}, keep_last: 3, log_every: 1,
          progress_bar: false}}
strategy: {{accelerator: cpu}}
""")
    return path


def lm_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lm.cli", *args]


def environment() -> dict:
    # One thread per process: two processes share the two cores.
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
            "MASTER_PORT": str(29500 + os.getpid() % 1000)}


def lm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(lm_command(*args), env=environment(), capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"lm {' '.join(args)} -> {result.returncode}\n{result.stderr[-3000:]}")
    return result


def train(config: Path, run_dir: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    return lm("train", "--config", str(config), "--run_dir", str(run_dir), *flags, check=check)


def losses(run_dir: Path) -> list[float]:
    rows = {}
    for path in sorted(run_dir.glob("logs/version_*/metrics.csv")):
        with open(path) as f:
            rows.update({int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")})
    return [rows[k] for k in sorted(rows)]


def exported(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    # In this process: `lm export` of every format is one process, and the import of torch, Lightning and
    # DeepSpeed would cost more than the export itself.
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(kjv_data, tmp_path_factory) -> dict[str, Path]:
    """4 steps of each strategy (checkpoints at 2 and 4), and of one process."""
    tmp = tmp_path_factory.mktemp("scale_out")
    config = base_config(tmp, kjv_data)
    done = {"config": config}
    for name, flags in {"single": ONE_PROCESS, **STRATEGIES}.items():
        train(config, tmp / name, *flags)
        done[name] = tmp / name
    return done


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_strategy_matches_one_process_exports_and_resumes_exactly(runs, strategy, tmp_path):
    single, run_dir = runs["single"], runs[strategy]
    assert losses(run_dir) == pytest.approx(losses(single), rel=1e-5, abs=0)
    assert len(losses(run_dir)) == 4

    # Export -> from_pretrained: the same logits as the one-process run's plain checkpoint.
    a = exported(run_dir, tmp_path / "export")
    model = LanguageModel.from_pretrained(str(tmp_path / "export"))
    reference = LanguageModel.from_pretrained(str(tmp_path / "export"))
    plain = torch.load(step_checkpoints(single / "checkpoints")[0], weights_only=True)["state_dict"]
    reference.load_state_dict({k.removeprefix("model."): v for k, v in plain.items()})
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[0], reference(tokens)[0], rtol=0, atol=1e-5)
    assert (tmp_path / "export" / "tokenizer.json").is_file()

    # Exact resume: drop the last checkpoint and continue from step 2 with the same strategy.
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step=00000004.ckpt", ignore_errors=True)
    (resumed / "checkpoints" / "step=00000004.ckpt").unlink(missing_ok=True)
    train(runs["config"], resumed, *STRATEGIES[strategy])
    b = exported(resumed, tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_process_checkpoint_continues_in_one_process(runs, tmp_path):
    resumed = tmp_path / "one"
    shutil.copytree(runs["ddp"], resumed)
    (resumed / "checkpoints" / "step=00000004.ckpt").unlink()
    train(runs["config"], resumed, *ONE_PROCESS)
    a, b = exported(runs["ddp"], tmp_path / "a"), exported(resumed, tmp_path / "b")
    for k in a:  # the same windows in the same order; only the reduction order differs
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_deepspeed_checkpoint_resumes_elsewhere_with_weights_alone(runs, tmp_path):
    resumed = tmp_path / "elsewhere"
    shutil.copytree(runs["zero2"], resumed)
    shutil.rmtree(resumed / "checkpoints" / "step=00000004.ckpt")
    result = train(runs["config"], resumed, *ONE_PROCESS)
    assert "resuming with its weights and a fresh optimizer state" in result.stderr
    assert step_checkpoints(resumed / "checkpoints")[0].name == "step=00000004.ckpt"


def test_damaged_checkpoint_is_refused_and_the_previous_one_used(runs, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(runs["zero2"], damaged)
    newest = damaged / "checkpoints" / "step=00000004.ckpt"
    shard = next((newest / "checkpoint").glob("zero_pp_rank_1_*"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    assert "bytes" in checkpoint_problem(newest)
    (damaged / "checkpoints" / "step=00000006.ckpt.tmp").mkdir()  # a save that never finished

    explicit = train(runs["config"], damaged, "--resume", str(newest), *STRATEGIES["zero2"], check=False)
    assert explicit.returncode == 2
    assert explicit.stderr.strip().count("\n") == 0 and "Traceback" not in explicit.stderr
    assert "zero_pp_rank_1" in explicit.stderr

    result = train(runs["config"], damaged, "--trainer.max_steps", "4", *STRATEGIES["zero2"])
    assert "skipping checkpoint" in result.stderr
    assert "step=00000004.ckpt" in result.stderr  # it warned about the damaged one, then resumed from step 2
    assert checkpoint_problem(newest) is None  # step 4 was written again, whole


def test_sigusr1_checkpoints_at_a_step_boundary_and_resumes_identically(kjv_data, tmp_path):
    config = base_config(tmp_path, kjv_data, steps=80, ckpt_every=5)
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    train(config, reference, *STRATEGIES["ddp"])

    process = subprocess.Popen(lm_command("train", "--config", str(config), "--run_dir", str(stopped),
                                          *STRATEGIES["ddp"]),
                               env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not step_checkpoints(stopped / "checkpoints") and time.time() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == STOPPED_EXIT_CODE, stderr[-2000:]
    assert "stopped on request" in stderr
    step = int(step_checkpoints(stopped / "checkpoints")[0].name[5:13])
    assert 5 <= step < 80

    train(config, stopped, *STRATEGIES["ddp"])
    a, b = exported(reference, tmp_path / "a"), exported(stopped, tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_batch_arithmetic():
    assert resolve_accumulation(256, micro_batch=16, accumulate=None, world=1) == 16
    assert resolve_accumulation(256, micro_batch=16, accumulate=None, world=8) == 2
    assert resolve_accumulation(None, micro_batch=16, accumulate=4, world=8) == 4
    assert global_batch_of(None, 256 * 2048, seq_len=2048) == 256
    with pytest.raises(UserError, match="not a multiple"):
        resolve_accumulation(256, micro_batch=16, accumulate=None, world=3)
    with pytest.raises(UserError, match="must be 2"):
        resolve_accumulation(256, micro_batch=16, accumulate=16, world=8)
    with pytest.raises(UserError, match="is not data.global_batch_tokens"):
        global_batch_of(256, 1000 * 2048, seq_len=2048)


@pytest.mark.parametrize("flags, message", [
    (["--strategy.name", "zero"], "strategy.name 'zero' is not one of"),
    (["--data.global_batch", "6", "--strategy.name", "ddp", "--strategy.devices", "2"],
     "micro_batch 2 x world size 2"),
    (["--strategy.name", "deepspeed", "--strategy.deepspeed_config", "missing.json"], "missing.json not found"),
])
def test_bad_strategy_settings_end_with_one_line(kjv_data, tmp_path, flags, message, capsys):
    # In this process: the settings are checked before any process is started.
    argv = ["train", "--config", str(base_config(tmp_path, kjv_data)), "--run_dir", str(tmp_path / "bad"), *flags]
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    assert stderr.strip().count("\n") == 0 and message in stderr, stderr[-2000:]
    assert not (tmp_path / "bad" / "checkpoints").exists()

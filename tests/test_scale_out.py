"""Real 2-process CPU runs (gloo) of DDP, DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 against one process with the same
global batch: same losses, exports that load with identical logits, exact resumes, a graceful stop on SIGUSR1,
and damaged checkpoints refused."""

import csv
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from strategy_runs import EVAL_TASKS, ONE_PROCESS, STRATEGIES, base_config, environment, train, train_here

from lm.cli import main
from lm.model import LanguageModel
from lm.training.batch import global_batch_of, resolve_accumulation
from lm.training.checkpoint import checkpoint_problem, step_checkpoints
from lm.training.stop_request import STOPPED_EXIT_CODE
from lm.util.errors import UserError

# The continuations from a run's step-2 checkpoint: name -> (the run, the flags of the launch that continues it).
RESUMES = {**{strategy: (strategy, flags) for strategy, flags in STRATEGIES.items()},
           "ddp in one process": ("ddp", ONE_PROCESS), "zero2 in one process": ("zero2", ONE_PROCESS),
           # The rest of the resume matrix: FSDP2 shards into one process (weights alone), a one-process file into
           # DDP(2), FSDP2 shards on another world size.
           "fsdp2 in one process": ("fsdp2", ONE_PROCESS), "single into ddp": ("single", STRATEGIES["ddp"]),
           "fsdp2 on one process": ("fsdp2", ["--strategy.name", "fsdp", "--strategy.devices", "1", *ONE_PROCESS])}
# The continuations the resume matrix refuses, with one line each before any process starts (run in this process).
REFUSED = {"single into fsdp2": ("single", STRATEGIES["fsdp2"], "cannot resume FSDP2"),
           "zero2 as zero3": ("zero2", STRATEGIES["zero3"], "cannot resume DeepSpeed"),
           "zero2 on one process": ("zero2", ["--strategy.name", "deepspeed", "--strategy.zero_stage", "2",
                                              "--strategy.devices", "1", *ONE_PROCESS], "cannot resume DeepSpeed")}


def losses(run_dir: Path, key: str = "train/loss") -> list[float]:
    rows = {}
    for path in sorted(run_dir.glob("logs/version_*/metrics.csv")):
        with open(path) as f:
            rows.update({int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)})
    return [rows[k] for k in sorted(rows)]


def last_launch_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, as the newest launch in run_dir logged them (each launch logs into a version of its own)."""
    newest = max(run_dir.glob("logs/version_*"), key=lambda p: int(p.name.split("_")[1]))
    with open(newest / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def exported(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    # In this process: `lm export` of every format is one process, and the import of torch, Lightning and
    # DeepSpeed would cost more than the export itself.
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(strategy_runs) -> dict[str, Path]:
    return strategy_runs


def damage(run_dir: Path) -> Path:
    """A DeepSpeed run's step-4 checkpoint with one shard truncated, and a save of step 6 that never finished: the
    damaged checkpoint."""
    newest = run_dir / "checkpoints" / "step=00000004.ckpt"
    shard = next((newest / "checkpoint").glob("zero_pp_rank_1_*"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    (run_dir / "checkpoints" / "step=00000006.ckpt.tmp").mkdir()
    return newest


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Each of RESUMES: a copy of its run without the step-4 checkpoint, continued to step 4: (run directory,
    launch). zero2's step-4 checkpoint is damaged instead of removed (`damage`): its continuation is also the resume
    past a damaged checkpoint (test_damaged_checkpoint_is_refused_...). Two launches at a time, as in `runs`, and
    meanwhile the continuations in one process in this one (train_here); each test checks the launch it uses
    (`continued`)."""
    tmp = tmp_path_factory.mktemp("resumed")

    def copy(name: str) -> Path:
        run_dir = shutil.copytree(runs[RESUMES[name][0]], tmp / name.replace(" ", "-"))
        newest = run_dir / "checkpoints" / "step=00000004.ckpt"  # a file, or a directory of shards
        if name == "zero2":
            damage(run_dir)
        else:
            shutil.rmtree(newest) if newest.is_dir() else newest.unlink()
        return run_dir

    def resume(name: str, environ: dict) -> tuple[Path, subprocess.CompletedProcess]:
        run_dir = copy(name)
        return run_dir, train(runs["config"], run_dir, *RESUMES[name][1], check=False, environ=environ)

    here = [name for name, (_, flags) in RESUMES.items() if flags is ONE_PROCESS]
    with ThreadPoolExecutor(2) as pool:
        # Each launch's environment is copied here, before this process trains (train_here).
        futures = {name: pool.submit(resume, name, environment()) for name in RESUMES if name not in here}
        done = {name: (run_dir, train_here(runs["config"], run_dir, *ONE_PROCESS))
                for name, run_dir in ((name, copy(name)) for name in here)}
        done.update({name: future.result() for name, future in futures.items()})
    return {name: done[name] for name in RESUMES}


def continued(resumed: dict, name: str) -> Path:
    """The run directory of a continuation that completed."""
    run_dir, result = resumed[name]
    assert result.returncode == 0, f"lm train ({name}) -> {result.returncode}\n{result.stderr[-3000:]}"
    return run_dir


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_strategy_matches_one_process_exports_and_resumes_exactly(runs, resumed, strategy, tmp_path):
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

    # Exact resume: drop the last checkpoint and continue from step 2 with the same strategy (`resumed`). The launch
    # names the checkpoint it restored and logs steps 3 and 4 with the losses of the uninterrupted run, bit for bit: a
    # launch that silently restarted from step 0 would end with the same weights, but not pass this.
    resumed_dir = continued(resumed, strategy)
    restored = resumed_dir / "checkpoints" / "step=00000002.ckpt"
    assert f"lm train: resuming from {restored}" in resumed[strategy][1].stderr
    after = last_launch_losses(resumed_dir)
    assert sorted(after) == [3, 4] and [after[3], after[4]] == losses(run_dir)[2:]
    b = exported(resumed_dir, tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_every_strategy_logs_the_steps_loss_and_gradient_norm(runs):
    """One process accumulates 2 micro-batches (ONE_PROCESS), each strategy's 2 processes take one each: the logged
    loss is the step's mean over both, and the gradient norm that of the step's whole gradient, as one process logs
    them (float32)."""
    for strategy in STRATEGIES:
        for key in ("train/loss", "train/grad_norm"):
            assert losses(runs[strategy], key) == pytest.approx(losses(runs["single"], key), rel=1e-5), (strategy, key)


def test_two_process_checkpoint_continues_in_one_process(runs, resumed, tmp_path):
    a = exported(runs["ddp"], tmp_path / "a")
    b = exported(continued(resumed, "ddp in one process"), tmp_path / "b")
    for k in a:  # the same windows in the same order; only the reduction order differs
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_deepspeed_checkpoint_resumes_elsewhere_with_weights_alone(resumed):
    run_dir = continued(resumed, "zero2 in one process")
    assert "resuming with its weights and a fresh optimizer state" in resumed["zero2 in one process"][1].stderr
    assert step_checkpoints(run_dir / "checkpoints")[0].name == "step=00000004.ckpt"


def test_the_rest_of_the_readmes_resume_matrix(runs, resumed, tmp_path, capsys, monkeypatch):
    """As docs/training.md says: a one-process checkpoint continues natively in DDP(2), and FSDP2 shards in FSDP2
    on one process; FSDP2 shards continue in one process with their weights and a fresh optimizer state, saying
    so; a plain checkpoint into FSDP2, and DeepSpeed shards at another stage or world size, end with one line,
    exit 2, before any step."""
    run_dir = continued(resumed, "fsdp2 in one process")
    assert "resuming with its weights and a fresh optimizer state" in resumed["fsdp2 in one process"][1].stderr
    assert step_checkpoints(run_dir / "checkpoints")[0].name == "step=00000004.ckpt"
    # Natively, optimizer state and all: the uninterrupted run's weights (to reduction order).
    for name, source in (("single into ddp", "single"), ("fsdp2 on one process", "fsdp2")):
        reference = exported(runs[source], tmp_path / f"{source}-reference")
        continuation = exported(continued(resumed, name), tmp_path / name.replace(" ", "-"))
        assert "fresh optimizer" not in resumed[name][1].stderr
        for k in reference:
            torch.testing.assert_close(reference[k], continuation[k], rtol=0, atol=1e-6)
    # Were a refused one let through, fitting would start a second process from this one: it fails the test instead.
    monkeypatch.setattr("lightning.pytorch.Trainer.fit", lambda *_, **__: pytest.fail("a refused resume was taken"))
    capsys.readouterr()  # the exports' lines above ("exported ... -> ...", on stderr)
    for name, (source, flags, message) in REFUSED.items():
        run_dir = shutil.copytree(runs[source], tmp_path / name.replace(" ", "-"))
        assert main(["train", "--config", str(runs["config"]), "--run_dir", str(run_dir), *flags]) == 2, name
        error = capsys.readouterr().err
        assert error.strip().count("\n") == 0 and message in error and "Traceback" not in error, (name, error)


def test_damaged_checkpoint_is_refused_and_the_previous_one_used(runs, resumed, tmp_path, capsys, monkeypatch):
    """A ZeRO-2 checkpoint with a truncated shard (`damage`): an explicit --resume of it ends in one line, naming the
    shard; a plain rerun warns, skips it (and a save that never finished) and resumes from the one before, writing
    the step again, whole (the rerun: `resumed`'s zero2 continuation)."""
    damaged = shutil.copytree(runs["zero2"], tmp_path / "damaged")
    newest = damage(damaged)
    assert "bytes" in checkpoint_problem(newest)

    # In this process: an explicit --resume is checked before any process is started (were it let through, fitting
    # would start the second process from this one: it fails the test instead).
    monkeypatch.setattr("lightning.pytorch.Trainer.fit", lambda *_, **__: pytest.fail("the damaged one was taken"))
    assert main(["train", "--config", str(runs["config"]), "--run_dir", str(damaged), "--resume", str(newest),
                 *STRATEGIES["zero2"]]) == 2
    explicit = capsys.readouterr().err
    assert explicit.strip().count("\n") == 0 and "Traceback" not in explicit
    assert "zero_pp_rank_1" in explicit

    rerun, result = continued(resumed, "zero2"), resumed["zero2"][1]
    assert "skipping checkpoint" in result.stderr
    assert "step=00000004.ckpt" in result.stderr  # it warned about the damaged one, then resumed from step 2
    assert f"resuming from {rerun / 'checkpoints' / 'step=00000002.ckpt'}" in result.stderr
    assert checkpoint_problem(rerun / "checkpoints" / "step=00000004.ckpt") is None  # step 4 was written again, whole


@pytest.mark.parametrize("strategy", ["zero2", "fsdp2"])
def test_a_flipped_byte_in_a_shard_is_caught_and_the_previous_checkpoint_taken(runs, strategy, tmp_path, capsys):
    """A byte changed inside one shard (its size intact) fails the sha256 in the checkpoint's manifest: the newest
    usable checkpoint is then the one before (the resume itself is test_damaged_checkpoint_is_refused_...)."""
    from lm.training.checkpoint import newest_checkpoint

    run_dir = shutil.copytree(runs[strategy], tmp_path / strategy)
    newest = run_dir / "checkpoints" / "step=00000004.ckpt"
    shard = max((p for p in newest.rglob("*") if p.is_file() and p.name != "lm-checkpoint.json"),
                key=lambda p: p.stat().st_size)  # the largest: weights or optimizer state, not metadata
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "damaged" in checkpoint_problem(newest)
    assert newest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step=00000002.ckpt"
    assert "skipping checkpoint" in capsys.readouterr().err


def test_sigusr1_checkpoints_at_a_step_boundary_and_resumes_identically(runs, tmp_path):
    """SIGUSR1 to the launched process alone (global rank 0; the other rank is not signalled) just after step 2:
    every rank stops at the next step boundary, step 3, with a checkpoint of it (not one of the every-2-steps ones),
    and exits 75; the rerun continues from it to the weights of the run never stopped (the shared DDP run), bit for
    bit. LM_FAULTS sends the notice at exactly that moment (one sent from another process could land after the last
    of the 4 steps), through the kernel to the listener thread that takes a notice from outside; notices from outside
    at any moment: tests/test_stops.py (one process) and tests/test_slurm.py (DDP on 2 nodes)."""
    stopped = tmp_path / "stopped"
    result = train(runs["config"], stopped, *STRATEGIES["ddp"], check=False, LM_FAULTS="signal@step:2@rank:0")
    assert result.returncode == STOPPED_EXIT_CODE, result.stderr[-3000:]
    assert "SIGUSR1: stopping at the next step with a checkpoint" in result.stderr
    assert "stopped on request at step 3 with a checkpoint" in result.stderr
    checkpoint = stopped / "checkpoints" / "step=00000003.ckpt"
    assert step_checkpoints(stopped / "checkpoints")[0] == checkpoint
    assert losses(stopped) == losses(runs["ddp"])[:3]

    result = train(runs["config"], stopped, *STRATEGIES["ddp"])
    assert f"lm train: resuming from {checkpoint}" in result.stderr
    assert last_launch_losses(stopped) == {4: losses(runs["ddp"])[3]}
    a, b = exported(runs["ddp"], tmp_path / "a"), exported(stopped, tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_in_loop_evaluation_under_ddp_scores_as_lm_eval_harness_on_the_checkpoint(runs, tmp_path):
    """`eval.every` on 2 DDP processes (the shared DDP run, at its last step: strategy_runs.in_loop_eval): every rank
    evaluates the current weights (and they agree, or the run stops); the logged scores are those `lm eval harness`
    gives the checkpoint of the same step. The losses and weights the tests above compare are this run's."""
    import json

    run_dir, tasks = runs["ddp"], runs["eval_tasks"]
    with open(next(run_dir.glob("logs/version_*/metrics.csv"))) as f:
        (logged,) = [r for r in csv.DictReader(f) if r.get("eval/lm_local_text/word_perplexity")]
    assert logged["step"] == "4"  # the row of step 4's loss
    assert main(["eval", "harness", "--checkpoint", str(run_dir / "checkpoints" / "step=00000004.ckpt"), "--tasks",
                 EVAL_TASKS, "--include_path", str(tasks), "--out", str(tmp_path / "h")]) == 0
    results = json.loads((tmp_path / "h" / "results.json").read_text())["results"]
    assert float(logged["eval/lm_local_choice/acc"]) == results["lm_local_choice"]["acc,none"]
    assert float(logged["eval/lm_local_text/word_perplexity"]) == pytest.approx(
        results["lm_local_text"]["word_perplexity,none"], rel=1e-5)


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

"""Real Lightning runs on CPU: exact resume (also after SIGKILL), checkpoints, logs, bad input, eval, generate."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lm.cli import main
from lm.training.checkpoint import newest_checkpoint, step_checkpoints
from lm.training.config import parse_run_config
from lm.training.train import train

STEPS = 8


def config_file(tmp_path: Path, data: str, run_dir: Path, **trainer) -> Path:
    settings = {**dict(max_steps=STEPS, val_every=4, ckpt_every=4, keep_last=2, log_every=1,
                       progress_bar=False), **trainer}
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(f"""
run_dir: {run_dir}
seed: 3
model: {{vocab_size: 512, d_model: 64, n_layers: 2, n_heads: 2, head_dim: 32, max_seq_len: 64}}
data: {{path: {data}, seq_len: 64, micro_batch: 4, num_workers: 1, val_windows: 8}}
optim: {{lr: 3.0e-3, warmup_steps: 2}}
strategy: {{accelerator: cpu}}
trainer: {{{", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items())}}}
""")
    return path


def run(config: Path, *overrides: str) -> Path:
    cfg, resume, yaml = parse_run_config(["--config", str(config), *overrides])
    return train(cfg, resume, yaml)


def logged_losses(run_dir: Path) -> dict[int, float]:
    losses = {}
    for path in sorted(run_dir.glob("logs/version_*/metrics.csv")):
        with open(path) as f:
            losses.update({int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]})
    return losses


def last_launch_losses(run_dir: Path) -> dict[int, float]:
    """The losses that the newest launch in run_dir logged (each launch logs into a version of its own)."""
    newest = max(run_dir.glob("logs/version_*"), key=lambda p: int(p.name.split("_")[1]))
    with open(newest / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]}


def assert_resumed_at(run_dir: Path, step: int, reference: Path, stderr: str):
    """The newest launch restored the step-`step` checkpoint (its log says so), logged the steps after it, and
    logged the reference's losses there bit for bit: a launch that restarted from step 0 fails all three."""
    assert f"lm train: resuming from {run_dir / 'checkpoints' / f'step={step:08d}.ckpt'}" in stderr, stderr[-2000:]
    after, expected = last_launch_losses(run_dir), logged_losses(reference)
    assert min(after) == step + 1 and all(after[s] == expected[s] for s in after), (after, expected)


def weights(checkpoint: Path) -> dict:
    return torch.load(checkpoint, weights_only=True)["state_dict"]


def assert_same_weights(a: Path, b: Path):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def straight(kjv_data, tmp_path_factory) -> Path:
    """A run of STEPS steps without interruption: the reference."""
    tmp = tmp_path_factory.mktemp("straight")
    run(config_file(tmp, kjv_data, tmp / "straight"))
    return tmp / "straight"


def test_run_directory_holds_config_logs_checkpoints_and_tokenizer(straight):
    assert (straight / "config.yaml").exists() and (straight / "tokenizer.json").exists()
    names = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert names == ["step=00000004.ckpt", "step=00000004.ckpt.lm-checkpoint.json", "step=00000008.ckpt",
                     "step=00000008.ckpt.lm-checkpoint.json"]  # each checkpoint with its manifest (sizes, sha256)
    names = names[::2]
    checkpoint = torch.load(straight / "checkpoints" / names[-1], weights_only=True)
    assert checkpoint["global_step"] == STEPS
    assert checkpoint["TokenDataModule"] == {"windows_consumed": STEPS * 4}
    assert {"optimizer_states", "lr_schedulers", "rng", "hyper_parameters"} <= checkpoint.keys()
    with open(next(straight.glob("logs/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/ppl", "val/loss", "val/ppl",
                "train/device/items_per_sec"):
        assert any(r.get(key) for r in rows), key


def test_resume_gives_identical_losses_and_weights(straight, kjv_data, tmp_path):
    config = config_file(tmp_path, kjv_data, tmp_path / "halves")
    run(config, "--trainer.max_steps", str(STEPS))  # the schedule's length stays STEPS ...
    # ... so stop halfway by hand: delete nothing, rerun from the step-4 checkpoint into a fresh directory.
    resumed = tmp_path / "resumed"
    first_half = tmp_path / "halves" / "checkpoints" / "step=00000004.ckpt"
    run(config_file(tmp_path, kjv_data, resumed), "--resume", str(first_half))
    assert_same_weights(straight / "checkpoints/step=00000008.ckpt", resumed / "checkpoints/step=00000008.ckpt")
    reference, after = logged_losses(straight), logged_losses(resumed)
    assert sorted(after) == list(range(5, STEPS + 1))  # steps 5..8 are the second half
    assert all(after[s] == reference[s] for s in after)


def final_val_loss(run_dir: Path) -> float:
    newest = max(run_dir.glob("logs/version_*"), key=lambda p: int(p.name.split("_")[1]))
    with open(newest / "metrics.csv") as f:
        return float([r for r in csv.DictReader(f) if r.get("val/loss")][-1]["val/loss"])


def test_a_rerun_and_a_resumed_run_agree_bit_for_bit_and_record_what_made_them(straight, kjv_data, tmp_path):
    """The straight run trained again from nothing, and again stopped after step 4 and resumed: the same final
    validation loss and weights, bit for bit. Each run's record names the commit of this checkout (and whether lm/
    differs from it), torch, the threads and the data's manifest checksum; the resumed run's, two launches, the second
    from step 4."""
    import hashlib

    from lm.training.run_record import read_record

    again, resumed = tmp_path / "again", tmp_path / "resumed"
    run(config_file(tmp_path, kjv_data, again))
    config = config_file(tmp_path, kjv_data, resumed)
    run(config)
    (resumed / "checkpoints" / "step=00000008.ckpt").unlink()  # as if stopped after step 4
    run(config)
    for other in (again, resumed):
        assert final_val_loss(other) == final_val_loss(straight)
        assert_same_weights(straight / "checkpoints/step=00000008.ckpt", other / "checkpoints/step=00000008.ckpt")
    root = Path(__file__).resolve().parents[1]
    git = lambda *args: subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout  # noqa
    record = read_record(straight)
    assert record["code"]["commit"] == git("rev-parse", "HEAD").strip()
    assert record["code"]["dirty"] == bool(git("status", "--porcelain", "--", "lm").strip())
    assert record["software"]["torch"] == torch.__version__
    assert record["machine"]["torch_threads"] == torch.get_num_threads()
    manifest = hashlib.sha256((Path(kjv_data) / "manifest.json").read_bytes()).hexdigest()
    assert [d["manifest_sha256"] for d in record["data"]] == [manifest]
    launches = read_record(resumed)["launches"]
    assert [launch["step"] for launch in launches] == [0, 4] and read_record(resumed)["mixed"] == []


def test_rerun_in_the_same_directory_continues(straight, kjv_data, tmp_path, capsys):
    run_dir = tmp_path / "twice"
    config = config_file(tmp_path, kjv_data, run_dir)
    run(config, "--trainer.max_steps", str(STEPS), "--trainer.ckpt_every", "4")
    (run_dir / "checkpoints" / "step=00000008.ckpt").unlink()  # as if stopped after step 4
    capsys.readouterr()
    run(config)
    assert_resumed_at(run_dir, 4, straight, capsys.readouterr().err)
    assert_same_weights(straight / "checkpoints/step=00000008.ckpt", run_dir / "checkpoints/step=00000008.ckpt")
    assert len(list(run_dir.glob("logs/version_*"))) == 2  # each launch logs separately, nothing overwritten


def test_a_flipped_byte_is_caught_and_the_previous_checkpoint_used(straight, kjv_data, tmp_path, capsys):
    """A byte changed inside a checkpoint (its size and zip directory intact) fails its sha256: an explicit --resume
    to it is one line and writes nothing; an automatic resume skips it with a warning and takes the one before."""
    import shutil

    from lm.training.checkpoint import checkpoint_problem

    run_dir = shutil.copytree(straight, tmp_path / "flipped")
    newest = run_dir / "checkpoints" / "step=00000008.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert "damaged" in checkpoint_problem(newest)
    config = config_file(tmp_path, kjv_data, run_dir)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    one_line_error(capsys, ["train", "--config", str(config), "--resume", str(newest)], "sha256")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before
    run(config)
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "damaged" in err
    assert_resumed_at(run_dir, 4, straight, err)
    assert checkpoint_problem(newest) is None  # step 8 was written again, whole
    assert_same_weights(straight / "checkpoints/step=00000008.ckpt", newest)


def test_sigkill_between_checkpoints_then_resume(straight, kjv_data, tmp_path, capsys):
    """SIGKILL after step 3 (LM_FAULTS sends it from inside, at exactly that step), a checkpoint every 2 steps: the
    killed launch leaves the step-2 checkpoint as its newest, and the rerun (in this process, as the command line
    runs it) resumes from exactly that one."""
    run_dir = tmp_path / "killed"
    config = config_file(tmp_path, kjv_data, run_dir, ckpt_every=2)
    cmd = [sys.executable, "-m", "lm.cli", "train", "--config", str(config)]
    env = {**os.environ, "WANDB_MODE": "offline"}
    killed = subprocess.run(cmd, env={**env, "LM_FAULTS": "kill@step:3"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert [p.name for p in step_checkpoints(run_dir / "checkpoints")] == ["step=00000002.ckpt"]
    capsys.readouterr()
    code, err = main(["train", "--config", str(config)]), capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert_resumed_at(run_dir, 2, straight, err)
    assert_same_weights(straight / "checkpoints/step=00000008.ckpt", run_dir / "checkpoints/step=00000008.ckpt")
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_a_stop_notice_at_any_moment_ends_in_0_or_75_and_the_run_then_matches(straight, kjv_data, tmp_path):
    """SIGUSR1 at each moment of a run's life (LM_FAULTS sends it from inside, at exactly that moment): the launch
    ends with 75 (a checkpoint written; run again) or 0 (complete), never by the signal, and each run ends with the
    uninterrupted run's weights. One run is stopped three times in a row (start-up, validation, the writing of its
    last checkpoint), each launch resuming the one before (notices mid-training: the SIGTERM and NaN tests below);
    another takes it after the last step. One more is sent notices from outside every 20 ms from its last checkpoint
    on, through its exit: Python gives back the default action of a signal while it shuts down, which would kill the
    process by it."""
    from concurrent.futures import ThreadPoolExecutor

    from lm.training.stop_request import STOPPED_EXIT_CODE

    def launches(name: str, moments: list[str]) -> list[int]:
        cmd = [sys.executable, "-m", "lm.cli", "train", "--config",
               str(config_file(tmp_path, kjv_data, tmp_path / name))]
        env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
        codes = []
        for moment in moments:
            if moment == "exit":
                process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                while not (tmp_path / name / "checkpoints" / "step=00000008.ckpt").exists() and process.poll() is None:
                    time.sleep(0.005)
                while process.poll() is None:
                    process.send_signal(signal.SIGUSR1)
                    time.sleep(0.02)
                done = subprocess.CompletedProcess(cmd, process.wait(), "", process.stderr.read())
            else:
                done = subprocess.run(cmd, env={**env, "LM_FAULTS": f"signal@{moment}"}, capture_output=True,
                                      text=True)
            assert done.returncode in (0, STOPPED_EXIT_CODE), (moment, done.returncode, done.stderr[-2000:])
            codes.append(done.returncode)
        return codes

    chains = {"stopped": ["fit_start", "validation", "checkpoint"], "after": ["train_end"], "exit": ["exit"]}
    with ThreadPoolExecutor(2) as pool:
        codes = dict(zip(chains, pool.map(launches, chains, chains.values())))
    assert codes == {"stopped": [STOPPED_EXIT_CODE] * 2 + [0], "after": [0], "exit": [0]}
    for name in chains:
        assert_same_weights(straight / "checkpoints/step=00000008.ckpt",
                            tmp_path / name / "checkpoints" / "step=00000008.ckpt")


def test_sigterm_mid_accumulation_stops_at_the_step_boundary_and_resumes_exactly(kjv_data, tmp_path, monkeypatch):
    """A time limit's SIGTERM in the middle of an accumulation (2 micro-batches per step): all of the step is done,
    a checkpoint written, exit 75; the rerun ends with the weights of the run never stopped. (`lm train` in this
    process, as the command line runs it: LM_FAULTS sends the notice to this process, whose listener takes it.)"""
    from lm.training.stop_request import STOPPED_EXIT_CODE

    def launch(name: str, faults: str) -> int:
        config = config_file(tmp_path, kjv_data, tmp_path / name)
        monkeypatch.setenv("LM_FAULTS", faults)
        return main(["train", "--config", str(config), "--data.micro_batch", "2", "--trainer.accumulate", "2"])

    reference, stopped = launch("reference", ""), launch("stopped", "sigterm@step:2")
    assert (reference, stopped) == (0, STOPPED_EXIT_CODE)
    assert newest_checkpoint(tmp_path / "stopped" / "checkpoints").name == "step=00000003.ckpt"
    assert launch("stopped", "") == 0
    assert_same_weights(tmp_path / "reference/checkpoints/step=00000008.ckpt",
                        tmp_path / "stopped/checkpoints/step=00000008.ckpt")


def test_non_finite_gradients_skip_their_steps_and_enough_in_a_row_stop_the_run(kjv_data, tmp_path, monkeypatch,
                                                                                capsys):
    """LM_FAULTS makes the gradients of steps 2 and 3 NaN. Those steps leave the weights and AdamW's moments as they
    were, and are counted; a run stopped in between and resumed ends as the uninterrupted one; with stop_after_skips 2
    the second skip stops the run with a checkpoint and one line naming the step."""
    from lm.training.stop_request import StoppedForRequeue

    monkeypatch.setenv("LM_FAULTS", "nan_grad@2,nan_grad@3")
    whole = tmp_path / "whole"
    run(config_file(tmp_path, kjv_data, whole, ckpt_every=2, keep_last=-1))
    step = lambda n: torch.load(whole / "checkpoints" / f"step={n:08d}.ckpt", weights_only=True)  # noqa: E731
    before, after = step(2), step(4)  # the skipped steps are the third and fourth: 0-based 2 and 3
    assert all(torch.equal(before["state_dict"][k], after["state_dict"][k]) for k in before["state_dict"])
    moments = lambda c: [t for s in c["optimizer_states"][0]["state"].values() for t in s.values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(moments(before), moments(after)))
    assert after["stability"] == {"skipped_steps": 2, "skips_in_a_row": 2}
    assert step(6)["stability"] == {"skipped_steps": 2, "skips_in_a_row": 0}
    assert not all(torch.equal(after["state_dict"][k], step(6)["state_dict"][k]) for k in after["state_dict"])
    with open(next(whole.glob("logs/version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/skipped_steps")]
    assert float(rows[-1]["train/skipped_steps"]) == 2 and any(r.get("train/loss_spike") for r in rows)

    # A stop notice between the two skipped steps, then a resume: the weights of the uninterrupted run.
    halves = tmp_path / "halves"
    monkeypatch.setenv("LM_FAULTS", "nan_grad@2,nan_grad@3,signal@step:2")
    with pytest.raises(StoppedForRequeue):
        run(config_file(tmp_path, kjv_data, halves, ckpt_every=2, keep_last=-1))
    monkeypatch.setenv("LM_FAULTS", "nan_grad@2,nan_grad@3")
    run(config_file(tmp_path, kjv_data, halves, ckpt_every=2, keep_last=-1))
    assert_same_weights(whole / "checkpoints/step=00000008.ckpt", halves / "checkpoints/step=00000008.ckpt")

    stopped = tmp_path / "stopped"
    capsys.readouterr()
    assert main(["train", "--config", str(config_file(tmp_path, kjv_data, stopped)),
                 "--trainer.stop_after_skips", "2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("lm train: stopped at step 4: the "
                                                                              "gradients of 2 steps in a row"), err
    assert (stopped / "checkpoints" / "step=00000004.ckpt").is_file()


def one_line_error(capsys, argv: list[str], pattern: str):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert pattern in err, err


def test_bad_input_ends_with_one_line_and_status_2(kjv_data, tmp_path, capsys):
    config = config_file(tmp_path, kjv_data, tmp_path / "bad")
    one_line_error(capsys, ["train", "--config", str(config), "--optim.lrr", "1"], "did you mean 'optim.lr'")
    typo = tmp_path / "typo.yaml"
    typo.write_text(config.read_text().replace("warmup_steps", "warmup_step"))
    one_line_error(capsys, ["train", "--config", str(typo)], "did you mean 'optim.warmup_steps'")
    one_line_error(capsys, ["train", "--config", str(tmp_path / "nope.yaml")], "nope.yaml")
    one_line_error(capsys, ["train", "--config", str(config), "--model.vocab_size", "100"], "vocab mismatch")
    one_line_error(capsys, ["train", "--config", str(config), "--data.seq_len", "128"], "max_seq_len")
    one_line_error(capsys, ["train", "--config", str(config), "--data.path", str(tmp_path)], "manifest")
    one_line_error(capsys, ["train", "--config", str(config), "--resume", "last"], "no checkpoint")
    one_line_error(capsys, ["eval", "ppl", "--checkpoint", str(tmp_path / "missing.ckpt")], "not found")
    assert not (tmp_path / "bad" / "checkpoints").exists()


# What a launcher (SLURM, torchrun, Lightning for its own processes) sets in each process: cleared for each case.
LAUNCH_ENV = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
TWO_NODES = ["--strategy.name", "ddp", "--strategy.num_nodes", "2"]
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, flags, message", [
    # Nodes started by hand as the refusal of num_nodes without a launcher says, but without where they meet: each
    # node would pick a port of its own (Lightning), or look for the first node on itself, and wait forever.
    ({"MASTER_ADDR": "127.0.0.1", "NODE_RANK": "1"}, TWO_NODES, "started by hand needs MASTER_PORT set alike"),
    ({"NODE_RANK": "1", "MASTER_PORT": "29500"}, TWO_NODES, "started by hand needs MASTER_ADDR set alike"),
    # torchrun's processes are not the run's: 2 for a one-device run (each would train alone in the run directory),
    # 2 for a run of 4 (they would wait for the other 2).
    (TORCHRUN, [], "torchrun started 2 processes but the run needs strategy.num_nodes x strategy.devices = 1"),
    (TORCHRUN, ["--strategy.name", "ddp", "--strategy.devices", "4"], "strategy.devices = 4: start it with torchrun"),
], ids=["no-port", "no-address", "torchrun-for-one", "torchrun-too-few"])
def test_processes_started_outside_a_launcher_that_cannot_meet_are_one_line(env, flags, message, kjv_data, tmp_path,
                                                                           capsys, monkeypatch):
    """(Nodes started by hand with the address and port train: tests/test_context_parallel_train.py.)"""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # Were one let through, fitting would wait for its peers forever: it fails the test instead.
    monkeypatch.setattr("lightning.pytorch.Trainer.fit", lambda *_, **__: pytest.fail("the launch was taken"))
    run_dir = tmp_path / "run"
    one_line_error(capsys, ["train", "--config", str(config_file(tmp_path, kjv_data, run_dir)), *flags], message)
    assert not run_dir.exists()


def test_unknown_key_from_the_real_command_line(kjv_data, tmp_path):
    config = config_file(tmp_path, kjv_data, tmp_path / "cli")
    done = subprocess.run([sys.executable, "-m", "lm.cli", "train", "--config", str(config), "--model.dmodel", "8"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "lm train: error: unknown config key 'model.dmodel' (did you mean 'model.d_model'?)"]


def test_perplexity_by_position_and_generation(straight, capsys):
    from lm.eval.ppl import evaluate_ppl
    from lm.generate import generate_text

    result = evaluate_ppl(str(straight))
    out = straight / "eval" / "ppl-validation-T64"
    assert (out / "per_position.png").stat().st_size > 1000
    rows = list(csv.DictReader(open(out / "per_position.csv")))
    assert int(rows[0]["position"]) == 1 and int(rows[-1]["position"]) == 64
    assert abs(float(rows[-1]["running_mean"]) - result["loss"]) < 1e-9
    assert 1 < result["ppl"] < 512  # better than uniform over the vocabulary after 8 steps
    text = generate_text(str(straight), prompt="And God said", max_new_tokens=10, seed=1)
    assert text.startswith("And God said") and len(text) > len("And God said")


def test_perplexity_at_longer_lengths_and_against_a_reference(straight, tmp_path):
    from lm.eval.ppl import evaluate_ppl
    from lm.util.errors import UserError

    result = evaluate_ppl(str(straight), multiples=[1, 2, 4], max_windows=8, out=str(tmp_path / "own"))
    assert sorted(result["ppl_by_length"]) == [64, 128, 256] and result["seq_len"] == 64
    for length in (64, 128, 256):
        rows = list(csv.DictReader(open(tmp_path / "own" / f"ppl-validation-T{length}" / "per_position.csv")))
        assert int(rows[-1]["position"]) == length
    # Against itself, the difference is zero everywhere; against the 2x curve, the lengths do not match.
    again = evaluate_ppl(str(straight), max_windows=8, out=str(tmp_path / "self"),
                         reference=str(tmp_path / "own" / "ppl-validation-T64"))
    rows = list(csv.DictReader(open(tmp_path / "self" / "per_position.csv")))
    assert again["reference"] and all(abs(float(r["nll_minus_reference"])) < 1e-9 for r in rows)
    assert (tmp_path / "self" / "per_position_vs_reference.png").stat().st_size > 1000
    with pytest.raises(UserError, match="was not evaluated at length 128"):
        evaluate_ppl(str(straight), seq_len=128, max_windows=8, out=str(tmp_path / "x"),
                     reference=str(tmp_path / "own" / "ppl-validation-T64"))


def test_mesa_run_logs_its_solves_gates_and_conditioning(kjv_data, tmp_path):
    """Mesa's `metrics()` reach metrics.csv through the generic hook (per layer and over layers), the adjoint solve's
    included, and `lm eval ppl`'s JSON."""
    run_dir = tmp_path / "mesa"
    run(config_file(tmp_path, kjv_data, run_dir, max_steps=2, val_every=2, ckpt_every=2), "--model.mixer", "mesa",
        "--model.mixer_options", "{mesa: {cg_steps: 8, cg_steps_eval: 4, cg_tol: 1.0e-3}}")
    with open(next(run_dir.glob("logs/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    logged = lambda key: [float(r[key]) for r in rows if r.get(key)]  # noqa: E731
    assert logged("train/cg_iterations") and all(0 < i <= 8 for i in logged("train/cg_iterations"))
    assert logged("train/cg_adjoint_iterations") and all(0 < i <= 8 for i in logged("train/cg_adjoint_iterations"))
    assert logged("val/cg_iterations") and all(0 < i <= 4 for i in logged("val/cg_iterations"))  # its own count
    assert all(0 <= r < 0.1 for r in logged("train/cg_residual_max") + logged("train/cg_adjoint_residual_max"))
    for key in ("lambda_min", "lambda_mean", "gamma_mean", "beta_mean", "cg_diag_ratio", "cg_residual"):
        assert logged(f"train/layer1/{key}") and logged(f"val/layer1/{key}"), key
    assert all(abs(value - 1) < 0.1 for value in logged("train/layer0/lambda_mean"))  # initialised at 1
    from lm.eval.ppl import evaluate_ppl

    result = evaluate_ppl(str(run_dir), max_windows=4, out=str(tmp_path / "ppl"))
    assert 0 < result["mixer_metrics"]["cg_iterations"] <= 4 and "layer1/gamma_mean" in result["mixer_metrics"]
    assert json.loads((tmp_path / "ppl" / "ppl.json").read_text())["mixer_metrics"] == result["mixer_metrics"]

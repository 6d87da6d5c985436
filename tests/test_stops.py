"""Every way a user stops a run keeps its work: SIGTERM, SIGUSR1 and SIGINT sent to the whole process group (SLURM's
time limit, `timeout`, Ctrl-C in a terminal), with a data-loader worker in the group, end the run with a checkpoint at
a step boundary and exit 75, without the validation that falls due there, and a rerun reaches the weights of the run
never stopped. Before the first step, a stop ends the run at once, in one line, with nothing written; also a stop
that reaches the ranks of a run in the instant between their arming. A second notice still checkpoints, unless it is a
Ctrl-C: that stops at once. A run that is not stopped ends with a validation of its last step."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lm.cli import main
from lm.training.checkpoint import newest_checkpoint
from lm.training.config import parse_run_config
from lm.training.stop_request import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE
from lm.training.train import train

STEPS, EVERY = 40, 4
SIGNALS = [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]


def config_file(tmp: Path, data: str, run_dir: Path, steps: int = STEPS, val_every: int = 1000, ckpt_every: int = EVERY,
                workers: int = 1) -> Path:
    path = tmp / f"{run_dir.name}.yaml"
    path.write_text(f"""
run_dir: {run_dir}
seed: 3
model: {{vocab_size: 512, d_model: 32, n_layers: 1, n_heads: 2, head_dim: 16, max_seq_len: 32}}
data: {{path: {data}, seq_len: 32, micro_batch: 2, num_workers: {workers}, val_windows: 4}}
optim: {{lr: 3.0e-3, warmup_steps: 2}}
strategy: {{accelerator: cpu}}
trainer: {{max_steps: {steps}, val_every: {val_every}, ckpt_every: {ckpt_every}, keep_last: 2, log_every: 1,
          progress_bar: false}}
""")
    return path


def validated_at(run_dir: Path) -> list[int]:
    """The steps whose rows in metrics.csv hold a validation loss, in the order written."""
    steps = []
    for path in sorted(run_dir.glob("logs/version_*/metrics.csv")):
        with open(path) as f:
            steps += [int(r["step"]) for r in csv.DictReader(f) if r.get("val/loss")]
    return steps


def launch(config: Path) -> subprocess.Popen:
    """`lm train` as a shell starts it: in a process group of its own, which the signals below are sent to."""
    return subprocess.Popen([sys.executable, "-m", "lm.cli", "train", "--config", str(config)],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def straight(kjv_data, tmp_path_factory, one_thread) -> Path:
    tmp = tmp_path_factory.mktemp("straight")
    train(*parse_run_config(["--config", str(config_file(tmp, kjv_data, tmp / "straight"))]))
    return tmp / "straight" / "checkpoints" / f"step={STEPS:08d}.ckpt"


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_to_the_group_mid_run_checkpoints_exits_75_and_the_rerun_matches(sig, straight, kjv_data, tmp_path,
                                                                                  capsys):
    run_dir = tmp_path / "run"
    config = config_file(tmp_path, kjv_data, run_dir)
    process = launch(config)
    while not (run_dir / "checkpoints" / f"step={EVERY:08d}.ckpt").exists():  # mid-run, the worker running
        assert process.poll() is None, process.stderr.read()[-3000:]
        time.sleep(0.002)
    os.killpg(process.pid, sig)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == STOPPED_EXIT_CODE, stderr[-3000:]
    assert "Traceback" not in stderr and "DataLoader worker" not in stderr, stderr[-3000:]
    stopped = newest_checkpoint(run_dir / "checkpoints")
    step = int(stopped.name[5:13])
    assert EVERY < step < STEPS and f"stopped on request at step {step} with a checkpoint" in stderr
    assert f"{sig.name}: stopping at the next step with a checkpoint" in stderr
    # The rerun in this process (main(), as the command line runs it): a launch of its own would import torch and
    # Lightning again for a few steps.
    capsys.readouterr()
    code, err = main(["train", "--config", str(config)]), capsys.readouterr().err
    assert code == 0 and f"resuming from {stopped}" in err, err[-3000:]
    ours, theirs = weights(run_dir / "checkpoints" / straight.name), weights(straight)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_to_the_group_before_the_first_step_ends_at_once_in_one_line(sig, kjv_data, tmp_path):
    run_dir = tmp_path / "run"
    process = launch(config_file(tmp_path, kjv_data, run_dir))
    time.sleep(0.3)  # importing torch: long before the first step
    os.killpg(process.pid, sig)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == STOPPED_EXIT_CODE, stderr[-3000:]
    assert stderr.strip().splitlines() == [f"lm train: {sig.name} before the first step: stopped at once, nothing to "
                                           "save; run again to start"]
    assert not run_dir.exists()


# A process that listens as `lm train` does, then waits in C (as in a distributed rendezvous) before or after training
# has started (arm): the listener thread acts even while the main thread does not run Python.
WAITER = """
import sys, time
from lm.training import stop_request
stop_request.listen()
if sys.argv[1] == "armed":
    stop_request.arm()
    stop_request.agree(False)
if sys.argv[1] == "arming":  # armed, and the other ranks never agree (gone)
    stop_request.ARMING_WAIT_S = 0.5
    stop_request.arm()
print("listening", flush=True)
time.sleep(600)
"""


def waiter(state: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", WAITER, state], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    assert process.stdout.readline() == "listening\n"
    return process


def test_a_stop_while_the_main_thread_waits_in_c_ends_at_once():
    process = waiter("not armed")
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=30) == STOPPED_EXIT_CODE
    assert "SIGTERM before the first step: stopped at once" in process.stderr.read()


def test_a_stop_noted_while_arming_ends_at_once_when_the_other_ranks_never_agree():
    """Where a collective waits for ever for a rank that is gone rather than failing (NCCL), the rank that noted the
    notice while the ranks armed ends by itself, ARMING_WAIT_S later, as before the first step."""
    process = waiter("arming")
    start = time.monotonic()
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=30) == STOPPED_EXIT_CODE
    assert time.monotonic() - start >= 0.5
    assert process.stderr.read().strip().splitlines() == ["lm train: SIGTERM before the first step: stopped at once, "
                                                          "nothing to save; run again to start"]


def test_a_stop_while_waiting_for_the_other_nodes_ends_at_once(kjv_data, tmp_path):
    """Node 0 of 2 started by hand (MASTER_ADDR, NODE_RANK), the other node never comes: the rendezvous waits in C,
    and a Ctrl-C to the group still ends it at once, in one line."""
    from strategy_runs import free_port

    run_dir = tmp_path / "run"
    config = config_file(tmp_path, kjv_data, run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "NODE_RANK": "0"}
    process = subprocess.Popen([sys.executable, "-m", "lm.cli", "train", "--config", str(config), "--strategy.name",
                                "ddp", "--strategy.num_nodes", "2"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = []
    while not any(line.startswith("Initializing distributed") for line in lines):
        line = process.stderr.readline()
        assert line, "".join(lines)[-3000:]
        lines.append(line)
    time.sleep(1)  # waiting for node 1
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=30) == STOPPED_EXIT_CODE
    assert process.stderr.read().strip().splitlines()[-1] == ("lm train: SIGINT before the first step: stopped at "
                                                              "once, nothing to save; run again to start")
    assert newest_checkpoint(run_dir / "checkpoints") is None


FIRST_LINE = {"SIGINT": "SIGINT: stopping at the next step with a checkpoint (Ctrl-C again stops at once, without one)",
              "SIGTERM": "SIGTERM: stopping at the next step with a checkpoint",
              "SIGUSR1": "SIGUSR1: stopping at the next step with a checkpoint"}


def test_a_second_notice_still_checkpoints_unless_it_is_a_ctrl_c():
    """Every pair of notices, to processes that listen as `lm train` does once training runs (one each, all at once):
    a second SIGTERM or SIGUSR1, after a first of any kind, leaves the stop to the checkpoint at the next step (the
    run below shows that it writes it); a Ctrl-C after any first notice stops at once, with 130."""
    pairs = [(first, second) for first in SIGNALS for second in SIGNALS]
    processes = [waiter("armed") for _ in pairs]
    try:
        for process, (first, _) in zip(processes, pairs):
            os.killpg(process.pid, first)
        for process, (first, _) in zip(processes, pairs):  # taken: the second cannot overtake it
            assert process.stderr.readline() == f"lm train: {FIRST_LINE[first.name]}\n"
        for process, (_, second) in zip(processes, pairs):
            os.killpg(process.pid, second)
        for process, (first, second) in zip(processes, pairs):
            if second == signal.SIGINT:
                assert process.wait(timeout=30) == INTERRUPTED_EXIT_CODE, (first.name, second.name)
                again = "Ctrl-C again" if first == signal.SIGINT else f"Ctrl-C after {first.name}"
                assert process.stderr.read() == f"lm train: {again}: stopped at once, without a checkpoint of this " \
                                                "step\n", (first.name, second.name)
            else:
                assert process.stderr.readline() == f"lm train: {second.name} as well: still stopping at the next " \
                                                    "step with a checkpoint\n", (first.name, second.name)
                time.sleep(0.2)
                assert process.poll() is None, (first.name, second.name)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_stop_checkpoints_its_step_without_a_validation_and_a_second_notice_changes_nothing(kjv_data, tmp_path,
                                                                                              capsys, monkeypatch):
    """Validation every 5 steps. A Ctrl-C during step 3, then a SIGTERM while the stop's checkpoint is written; the
    rerun, a SIGUSR1 during step 5, then a SIGTERM again. Each launch writes the checkpoint of its stop's step and
    exits 75, with a line for each notice, and no validation runs: neither the one Lightning adds after a step that
    stops training (step 3) nor the one due at the step (step 5). Either would spend the scheduler's warning. (Both
    launches in this process, as the command line runs them: LM_FAULTS sends the notices to this process, whose
    listener thread takes them.)"""
    run_dir = tmp_path / "run"
    config = config_file(tmp_path, kjv_data, run_dir, val_every=5, ckpt_every=1000, workers=0)
    for step, faults, first in [(3, "sigint@step:2,sigterm@checkpoint", "SIGINT"),
                                (5, "signal@step:4,sigterm@checkpoint", "SIGUSR1")]:
        monkeypatch.setenv("LM_FAULTS", faults)
        capsys.readouterr()
        code, stderr = main(["train", "--config", str(config)]), capsys.readouterr().err
        assert code == STOPPED_EXIT_CODE, stderr[-3000:]
        assert "Traceback" not in stderr
        lines = [line for line in stderr.splitlines() if line.startswith("lm train: SIG")]
        assert lines == [f"lm train: {FIRST_LINE[first]}",
                         "lm train: SIGTERM as well: still stopping at the next step with a checkpoint"], stderr
        assert stderr.strip().splitlines()[-1] == (f"lm train: stopped on request at step {step} with a "
                                                   "checkpoint; run again to resume")
        assert newest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / f"step={step:08d}.ckpt"
    assert validated_at(run_dir) == []


def test_a_run_ends_with_one_validation_of_its_last_step(straight, kjv_data, tmp_path):
    """40 steps, validation every 1000: one validation, after step 40. 8 steps, every 4: after 4 and 8, once each."""
    assert validated_at(straight.parent.parent) == [STEPS]
    run_dir = tmp_path / "run"
    train(*parse_run_config(["--config", str(config_file(tmp_path, kjv_data, run_dir, steps=8, val_every=4,
                                                         ckpt_every=1000, workers=0))]))
    assert validated_at(run_dir) == [4, 8]


def test_a_stop_between_the_ranks_arming_ends_every_rank_at_once(kjv_data, tmp_path):
    """A SIGTERM that rank 1 takes just before it arms (it ends at once: nothing to save) and rank 0 just after (noted,
    to stop at the first step): rank 0 must not wait for rank 1 at the first step's all-reduce. Both end at once, in
    one line, with 75 (the test reads the output to its end: every rank has closed it)."""
    from strategy_runs import environment

    run_dir = tmp_path / "run"
    config = config_file(tmp_path, kjv_data, run_dir, workers=0)
    process = subprocess.Popen([sys.executable, "-m", "lm.cli", "train", "--config", str(config), "--strategy.name",
                                "ddp", "--strategy.devices", "2"], env={**environment(), "LM_FAULTS": "sigterm@arming"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"a rank waits for ever: {process.communicate()[1][-3000:]}")
    assert process.returncode == STOPPED_EXIT_CODE, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ("lm train: SIGTERM before the first step: stopped at once, nothing to "
                                               "save; run again to start")
    assert newest_checkpoint(run_dir / "checkpoints") is None

"""Every way a user stops a run keeps its work: SIGTERM, SIGUSR1 and SIGINT sent to the whole process group (SLURM's
time limit, `timeout`, Ctrl-C in a terminal), with a data-loader worker in the group, end the run with a checkpoint at
a step boundary and exit 75, and a rerun reaches the weights of the run never stopped. Before the first step, a stop
ends the run at once, in one line, with nothing written. Ctrl-C twice stops at once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lm.training.checkpoint import newest_checkpoint
from lm.training.config import parse_run_config
from lm.training.stop_request import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE
from lm.training.train import train

STEPS, EVERY = 40, 4
SIGNALS = [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]


def config_file(tmp: Path, data: str, run_dir: Path) -> Path:
    path = tmp / f"{run_dir.name}.yaml"
    path.write_text(f"""
run_dir: {run_dir}
seed: 3
model: {{vocab_size: 512, d_model: 32, n_layers: 1, n_heads: 2, head_dim: 16, max_seq_len: 32}}
data: {{path: {data}, seq_len: 32, micro_batch: 2, num_workers: 1, val_windows: 4}}
optim: {{lr: 3.0e-3, warmup_steps: 2}}
strategy: {{accelerator: cpu}}
trainer: {{max_steps: {STEPS}, val_every: 1000, ckpt_every: {EVERY}, keep_last: 2, log_every: 1, progress_bar: false}}
""")
    return path


def launch(config: Path) -> subprocess.Popen:
    """`lm train` as a shell starts it: in a process group of its own, which the signals below are sent to."""
    return subprocess.Popen([sys.executable, "-m", "lm.cli", "train", "--config", str(config)],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def straight(kjv_data, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("straight")
    train(*parse_run_config(["--config", str(config_file(tmp, kjv_data, tmp / "straight"))]))
    return tmp / "straight" / "checkpoints" / f"step={STEPS:08d}.ckpt"


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_to_the_group_mid_run_checkpoints_exits_75_and_the_rerun_matches(sig, straight, kjv_data, tmp_path):
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
    rerun = subprocess.run([sys.executable, "-m", "lm.cli", "train", "--config", str(config)], capture_output=True,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})
    assert rerun.returncode == 0 and f"resuming from {stopped}" in rerun.stderr, rerun.stderr[-3000:]
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


def test_ctrl_c_twice_stops_at_once():
    process = waiter("armed")
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(0.5)
    assert process.poll() is None  # the first only asks for a checkpoint at the next step
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=30) == INTERRUPTED_EXIT_CODE
    lines = process.stderr.read().strip().splitlines()
    assert lines == ["lm train: SIGINT: stopping at the next step with a checkpoint (Ctrl-C again stops at once, "
                     "without one)", "lm train: Ctrl-C again: stopped at once, without a checkpoint of this step"]


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

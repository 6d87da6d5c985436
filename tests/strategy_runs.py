"""Launches of `lm train` in 2 processes per strategy (DDP, DeepSpeed ZeRO-2 / ZeRO-3, FSDP2) and in one process, on
one machine: tests/test_scale_out.py compares them with each other, and tests/test_slurm.py with the same runs on two
SLURM nodes (the conftest's `strategy_runs`, made once per session)."""

import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

STRATEGIES = {
    "ddp": ["--strategy.name", "ddp", "--strategy.devices", "2"],
    "zero2": ["--strategy.name", "deepspeed", "--strategy.zero_stage", "2", "--strategy.devices", "2"],
    "zero3": ["--strategy.name", "deepspeed", "--strategy.zero_stage", "3", "--strategy.devices", "2"],
    "fsdp2": ["--strategy.name", "fsdp", "--strategy.devices", "2"],
}
# The same global batch of 4 sequences as 2 processes x 2, in 2 micro-batches of 2: the loss and gradient norm that
# one process logs for a step are then those of both (tests/test_scale_out.py).
ONE_PROCESS = ["--data.micro_batch", "2"]
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


_ports_given: set[int] = set()
_ports_lock = threading.Lock()


def free_port() -> int:
    """A port the OS says is free (bound to port 0 on 127.0.0.1, read, closed), never one this process handed out
    before: launches that run at once must not meet."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _ports_lock:  # launches start from a thread pool
            if port not in _ports_given:
                _ports_given.add(port)
                return port


def environment() -> dict:
    # One thread per process: two processes share the two cores. Each launch gets a port of its own.
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "MASTER_PORT": str(free_port())}


def lm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(lm_command(*args), env=environment(), capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"lm {' '.join(args)} -> {result.returncode}\n{result.stderr[-3000:]}")
    return result


def train(config: Path, run_dir: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    return lm("train", "--config", str(config), "--run_dir", str(run_dir), *flags, check=check)


def train_every_strategy(tmp: Path, data: str) -> dict[str, Path]:
    """4 steps of each strategy (checkpoints at 2 and 4), and of one process. Two launches at a time: while one
    launch's processes import and meet, a core would wait."""
    config = base_config(tmp, data)
    launches = {"single": ONE_PROCESS, **STRATEGIES}
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(train, config, tmp / name, *flags) for name, flags in launches.items()]:
            future.result()
    return {"config": config, **{name: tmp / name for name in launches}}

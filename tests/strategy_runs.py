"""Launches of `lm train` in 2 processes per strategy (DDP, DeepSpeed ZeRO-2 / ZeRO-3, FSDP2), and a run in one
process, on one machine: tests/test_scale_out.py compares them with each other, and tests/test_slurm.py with the same
runs on two SLURM nodes (the conftest's `strategy_runs`, made once per session). The DDP run also evaluates in the
loop at its last step (in_loop_eval), for tests/test_scale_out.py's in-loop evaluation test."""

import contextlib
import io
import json
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
# Two lm-eval tasks read from a local file (no download): a multiple choice and a rolling log-likelihood.
LOCAL_TASKS = {
    "lm_local_choice": """task: lm_local_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {dir}/local.jsonl}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
""",
    "lm_local_text": """task: lm_local_text
dataset_path: json
dataset_kwargs: {{data_files: {{test: {dir}/local.jsonl}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{context}}}}{{{{choices[0]}}}}"
metric_list: [{{metric: word_perplexity}}]
"""}
EVAL_TASKS = "[lm_local_choice, lm_local_text]"


def write_local_tasks(folder: Path) -> Path:
    """LOCAL_TASKS and their three documents in folder (an lm-eval include path)."""
    folder.mkdir()
    with open(folder / "local.jsonl", "w") as f:
        for context, right, wrong in [("In the beginning", " God created", " the waters"),
                                      ("And God said,", " Let there be light", " the evening"),
                                      ("And the evening and the morning were the", " first day", " firmament")]:
            f.write(json.dumps({"context": context, "choices": [right, wrong]}) + "\n")
    for name, text in LOCAL_TASKS.items():
        (folder / f"{name}.yaml").write_text(text.format(dir=folder))
    return folder


def in_loop_eval(tasks: Path) -> list[str]:
    """The flags of the DDP run's in-loop evaluation: at step 4, its last, after its loss and before its checkpoint
    (the losses, weights and random states do not change: tests/test_in_loop_eval.py)."""
    return ["--eval.every", "4", "--eval.tasks", EVAL_TASKS, "--eval.include_path", str(tasks)]


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


def lm(*args: str, check: bool = True, environ: dict | None = None, **env: str) -> subprocess.CompletedProcess:
    """A launch of `lm`, in `environ` (else environment()) with env added."""
    result = subprocess.run(lm_command(*args), env={**(environ or environment()), **env}, capture_output=True,
                            text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"lm {' '.join(args)} -> {result.returncode}\n{result.stderr[-3000:]}")
    return result


def train(config: Path, run_dir: Path, *flags: str, check: bool = True, environ: dict | None = None,
          **env: str) -> subprocess.CompletedProcess:
    return lm("train", "--config", str(config), "--run_dir", str(run_dir), *flags, check=check, environ=environ, **env)


def train_here(config: Path, run_dir: Path, *flags: str, **env: str) -> subprocess.CompletedProcess:
    """`lm train` in one process, in this one (main(), as the command line runs it, in one thread as the launches,
    with env added to the environment): a launch of its own would spend most of its time importing torch and
    Lightning again. Its exit status and stderr. In the main thread (it handles the stop signals there). The
    environment is put back after, key by key: lm sets and removes variables of this process's while it trains
    (Lightning records its seed there), and a launch may be reading it meanwhile from another thread, or take a copy
    made before (environ=environment())."""
    import torch

    from lm.cli import main

    argv, err = ["train", "--config", str(config), "--run_dir", str(run_dir), *flags], io.StringIO()
    saved, threads = dict(os.environ), torch.get_num_threads()
    os.environ.update(env, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update({key: value for key, value in saved.items() if os.environ.get(key) != value})
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(argv, code, "", err.getvalue())


def train_every_strategy(tmp: Path, data: str) -> dict[str, Path]:
    """4 steps of each strategy (checkpoints at 2 and 4), and of one process; "eval_tasks": the DDP run's in-loop
    evaluation tasks (in_loop_eval). Two launches at a time: while one launch's processes import and meet, a core
    would wait; meanwhile the one process in this one (train_here)."""
    config, tasks = base_config(tmp, data), write_local_tasks(tmp / "tasks")
    launches = {**STRATEGIES, "ddp": [*STRATEGIES["ddp"], *in_loop_eval(tasks)]}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(train, config, tmp / name, *flags, environ=environment())
                   for name, flags in launches.items()]
        single = train_here(config, tmp / "single", *ONE_PROCESS)
        assert single.returncode == 0, f"lm train (single) -> {single.returncode}\n{single.stderr[-3000:]}"
        for future in futures:
            future.result()
    return {"config": config, "eval_tasks": tasks, "single": tmp / "single", **{name: tmp / name for name in launches}}

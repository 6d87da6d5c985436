"""lm.util.workers.run_jobs: results in the jobs' order whatever order they end in, each worker's threads set, each
job's output in its log, and a failure that names its job, in worker processes and in this one. A stop signal to the
process stops its jobs and starts no other: in workers, here, and for a real `lm compare ladder` process, whose stopped
training runs checkpoint and continue when it runs again.

Each spawned worker imports this module (its jobs are this module's functions): what only the ladder's test needs,
lm.training.checkpoint (Lightning: seconds per process), that test imports itself."""

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

from lm.cli import main
from lm.training.stop_request import STOPPED_EXIT_CODE
from lm.util.errors import UserError
from lm.util.workers import Stopped, run_jobs


def report(value: int, after: Path | None = None, then: Path | None = None) -> tuple:
    """A job (module-level, so that a spawned worker can unpickle it): what its worker was set to. It waits for the
    file `after` and then writes the file `then`, to end after or before another job."""
    deadline = time.monotonic() + 120
    while after and not after.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"job {value} speaking")
    if then:
        then.touch()
    return value, torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def fail(error: type, message: str):
    raise error(message)


def test_results_come_back_in_order_with_the_workers_threads_and_logs(tmp_path):
    signal = tmp_path / "quick ended"
    jobs = {"slow": partial(report, 1, after=signal), "quick": partial(report, 2, then=signal),
            "third": partial(report, 3)}
    logs = {name: tmp_path / f"{name}.log" for name in jobs}
    ended = []
    results = run_jobs(jobs, workers=2, threads=2, logs=logs, done=lambda name, result: ended.append(name))
    assert list(results) == ["slow", "quick", "third"]  # the jobs' order ...
    assert ended.index("quick") < ended.index("slow") and sorted(ended) == sorted(jobs)  # ... not the order they end
    assert list(results.values()) == [(1, 2, "2"), (2, 2, "2"), (3, 2, "2")]
    assert [logs[name].read_text() for name in jobs] == ["job 1 speaking\n", "job 2 speaking\n", "job 3 speaking\n"]


def test_a_failing_job_in_a_worker_is_named_with_its_log(tmp_path):
    logs = {name: tmp_path / f"{name}.log" for name in ("fine", "bad input")}
    with pytest.raises(UserError, match=r"^bad input: no such file \(its log: .*bad input\.log\)$"):
        run_jobs({"fine": partial(report, 1), "bad input": partial(fail, UserError, "no such file")}, 2, logs=logs)


def test_a_failing_job_here_is_named():
    fine = partial(report, 1)
    with pytest.raises(RuntimeError, match=r"^broken failed \(ValueError: boom\)$"):
        run_jobs({"fine": fine, "broken": partial(fail, ValueError, "boom")}, 1)
    with pytest.raises(UserError, match=r"^bad input: no such file$"):
        run_jobs({"fine": fine, "bad input": partial(fail, UserError, "no such file")}, 1)


def test_one_worker_runs_the_jobs_here_in_order_with_its_threads_untouched():
    threads, ended = torch.get_num_threads(), []
    results = run_jobs({"a": partial(report, 1), "b": partial(report, 2)}, workers=1,
                       done=lambda name, result: ended.append(name))
    assert ended == ["a", "b"] and [r[:2] for r in results.values()] == [(1, threads), (2, threads)]


def wait_for(started: Path, release: Path) -> str:
    """A job that says it has started, then waits (up to 120 s) for a file no one writes: only a stop ends it early."""
    started.touch()
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return "waited it out"


def signal_this_process_once(paths: list[Path], sig: int = signal.SIGTERM) -> threading.Thread:
    """Send `sig` to this process as soon as every path exists (the jobs have started)."""
    def send():
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in paths) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_stop_signal_ends_the_workers_jobs_and_starts_no_other(tmp_path):
    jobs = {name: partial(wait_for, tmp_path / f"{name} started", tmp_path / "never") for name in ("a", "b", "c")}
    before = signal.getsignal(signal.SIGTERM)  # what an earlier test in this process left (Lightning's, say)
    start = time.monotonic()
    sender = signal_this_process_once([tmp_path / "a started", tmp_path / "b started"])
    with pytest.raises(Stopped, match=r"^stopped on request \(SIGTERM\): 2 running job\(s\) stopped \((a, b|b, a)\), "
                                      r"1 not started; run the command again to continue$"):
        run_jobs(jobs, workers=2)
    sender.join()
    assert time.monotonic() - start < 60  # not the jobs' 120 s
    assert not (tmp_path / "c started").exists() and multiprocessing.active_children() == []
    assert signal.getsignal(signal.SIGTERM) is before  # this process's own handling is back


def test_a_stop_signal_ends_the_job_running_here_and_starts_no_other(tmp_path):
    jobs = {name: partial(wait_for, tmp_path / f"{name} started", tmp_path / "never") for name in ("a", "b")}
    before = signal.getsignal(signal.SIGINT)
    sender = signal_this_process_once([tmp_path / "a started"], signal.SIGINT)
    with pytest.raises(Stopped, match=r"^stopped on request \(SIGINT\): 1 running job\(s\) stopped \(a\), 1 not "):
        run_jobs(jobs, workers=1)
    sender.join()
    assert not (tmp_path / "b started").exists()
    assert signal.getsignal(signal.SIGINT) is before


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stopped_ladder_stops_its_workers_runs_and_its_rerun_continues_them(kjv_data, tmp_path, capsys):
    """`kill PID` on a local `lm compare ladder` (2 workers): both running training runs checkpoint and end, the ladder
    exits 75 in one line, and no worker outlives it. Run again, it skips the finished lr sweep and resumes each
    stopped run from its checkpoint."""
    from lm.training.checkpoint import newest_checkpoint

    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "seed": 0, "model": {"vocab_size": 512, "max_seq_len": 32},
        "data": {"path": kjv_data, "seq_len": 32, "micro_batch": 4, "global_batch": 4, "num_workers": 0,
                 "val_windows": 4},
        "optim": {"lr": 3.0e-3, "warmup_steps": 5},
        "trainer": {"val_every": 10**6, "ckpt_every": 5, "keep_last": 1, "log_every": 5, "progress_bar": False},
        "strategy": {"accelerator": "cpu", "devices": 1}}))
    (tmp_path / "ladder.yaml").write_text(yaml.safe_dump({  # the lr sweep: one run; then two runs at once
        "archs": ["attention"], "rungs": [1.0e5, 1.5e5, 2.2e5], "base": "base.yaml", "tokens_per_param": 0.2,
        "lr": {"grid": [3.0e-3], "sweep_rungs": 1, "against": "params", "slope": -1.0}}))
    out = tmp_path / "out"
    command = ["compare", "ladder", str(tmp_path / "ladder.yaml"), "--out", str(out), "--workers", "2"]
    err_file = tmp_path / "ladder.err"  # not a pipe: a worker that outlived the ladder would hold it open
    with open(err_file, "w") as err:
        ladder = subprocess.Popen([sys.executable, "-m", "lm.cli", *command], stdout=subprocess.DEVNULL, stderr=err,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while True:  # until both runs of the second stage have a checkpoint
            runs = [run for run in (out / "runs").glob("attention-*") if "-100k-" not in run.name]
            if len(runs) == 2 and all(newest_checkpoint(run / "checkpoints", warn=False) for run in runs):
                break
            assert ladder.poll() is None, err_file.read_text()[-3000:]
            assert time.monotonic() < deadline, "the ladder's second stage did not checkpoint within 240 s"
            time.sleep(0.05)
        spawned = children(ladder.pid)  # the pool's workers, and multiprocessing's resource tracker
        workers = [pid for pid in spawned if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        ladder.send_signal(signal.SIGTERM)
        ladder.wait(timeout=120)
    finally:
        ladder.kill()
    stderr = err_file.read_text()
    assert ladder.returncode == STOPPED_EXIT_CODE, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("lm compare ladder: stopped on request (SIGTERM): 2 running job(s) stopped"), stderr
    assert len(workers) == 2 and not [pid for pid in workers if alive(pid)]  # joined before the ladder ended
    deadline = time.monotonic() + 10  # the tracker ends once it sees that every holder of its pipe has
    while [pid for pid in spawned if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in spawned if alive(pid)]
    stopped_at = {}
    for run in runs:
        steps = yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_steps"]
        stopped_at[run] = newest_checkpoint(run / "checkpoints", warn=False)
        assert stopped_at[run].name < f"step={steps:08d}.ckpt", "the stop must land mid-run"
        log = (out / "logs" / f"{run.name}.log").read_text()
        assert "lm train: SIGTERM: stopping at the next step with a checkpoint" in log, log[-3000:]

    assert main([*command[:-1], "1"]) == 0  # the rerun, here with one worker
    err = capsys.readouterr().err
    # the sweep's run (seed 0) ended; the rungs' three (seed 1) are the two stopped and the one not started
    assert "lr-sweep:" not in err and "rungs: 3 of 3 runs to train (local)" in err, err[-3000:]
    for run in runs:
        steps = yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_steps"]
        assert f"lm train: resuming from {stopped_at[run]}" in err
        assert newest_checkpoint(run / "checkpoints").name == f"step={steps:08d}.ckpt"

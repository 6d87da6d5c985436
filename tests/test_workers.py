"""lm.workers.run_jobs: results in the jobs' order whatever order they end in, each worker's threads set, each job's
output in its log, and a failure that names its job, in worker processes and in this one."""

import os
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from lm.errors import UserError
from lm.workers import run_jobs


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

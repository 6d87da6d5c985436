"""Jobs in worker processes: `run_jobs` runs named jobs a few at a time, each worker with its threads set (and each
job's output in a log file of its own when asked), and gives the results back in the jobs' order. A job that fails
ends the run with an error that names it. lm compare demo, lm eval icl and lm eval mqar-grid run their jobs here.

Workers are spawned (not forked: torch's threads do not survive a fork), so a job is a picklable callable of no
arguments: a module-level function, or `functools.partial` of one. Nothing here imports torch until a worker sets
its threads, so OMP_NUM_THREADS is set before the worker's torch starts."""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm.errors import UserError


def set_threads(threads: int) -> None:
    """This process's torch threads (and OpenMP's, for a torch not imported yet): a worker's initializer."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def logged(job: Callable[[], Any], log: Path) -> Any:
    """Run `job` with this process's stdout and stderr sent to `log` for good (a worker that runs one job)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return job()


def failure(name: str, err: BaseException, log: Path | None) -> Exception:
    """The error that ends the run: a UserError stays one (its message led by the job's name), anything else becomes a
    RuntimeError naming the job and its error."""
    where = f" (its log: {log})" if log else ""
    if isinstance(err, UserError):
        return UserError(f"{name}: {err}{where}")
    return RuntimeError(f"{name} failed ({type(err).__name__}: {err}){where}")


def cause(err: BaseException) -> BaseException | None:
    """What a failure is raised from: a UserError's one line needs no traceback; anything else keeps its own."""
    return None if isinstance(err, UserError) else err


def run_jobs(jobs: dict[str, Callable[[], Any]], workers: int, threads: int = 1, logs: dict[str, Path] | None = None,
             done: Callable[[str, Any], None] | None = None) -> dict[str, Any]:
    """name -> job: runs them, started in the given order, `workers` at a time, and returns name -> result in that
    order.

    Args:
        jobs: Picklable callables of no arguments, by name.
        workers: Jobs at once, each in a spawned worker process of `threads` torch threads. With one worker (or one
            job) and no logs, the jobs run in this process instead, one after another, its threads untouched.
        threads: Torch threads of each worker process.
        logs: name -> a file for that job's stdout and stderr; then every job runs in a fresh process of its own
            (whatever `workers`), as the redirection lasts for the rest of the process.
        done: Called in this process with (name, result) as each job ends, in the order they end.

    Raises the first failure (UserError or RuntimeError, named as `failure` does) after cancelling the jobs not yet
    started (the running ones end first).
    """
    results = {}
    if logs is None and (workers <= 1 or len(jobs) <= 1):
        for name, job in jobs.items():
            try:
                results[name] = job()
            except Exception as err:
                raise failure(name, err, None) from cause(err)
            if done:
                done(name, results[name])
        return results

    from concurrent.futures import ProcessPoolExecutor, as_completed
    from functools import partial
    from multiprocessing import get_context

    fresh = {"max_tasks_per_child": 1} if logs is not None else {}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=set_threads, initargs=(threads,),
                             **fresh) as pool:
        futures = {pool.submit(partial(logged, job, logs[name]) if logs is not None else job): name
                   for name, job in jobs.items()}
        for future in as_completed(futures):
            name = futures[future]
            try:
                results[name] = future.result()
            except Exception as err:
                pool.shutdown(cancel_futures=True)
                raise failure(name, err, logs[name] if logs is not None else None) from cause(err)
            if done:
                done(name, results[name])
    return {name: results[name] for name in jobs}

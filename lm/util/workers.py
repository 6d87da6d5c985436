"""Jobs in worker processes: `run_jobs` runs named jobs a few at a time, each worker with its threads set (and each
job's output in a log file of its own when asked), and gives the results back in the jobs' order. A job that fails
ends the run with an error that names it. lm compare demo and ladder, lm eval icl and mqar-grid run their jobs here.

Workers are spawned (not forked: torch's threads do not survive a fork), so a job is a picklable callable of no
arguments: a module-level function, or `functools.partial` of one. Nothing here imports torch until a worker sets
its threads, so OMP_NUM_THREADS is set before the worker's torch starts.

A stop request (SIGTERM, SIGINT or SIGUSR1 to this process: `kill PID`, Ctrl-C, a scheduler's notice) stops the jobs
with it: the running ones are sent SIGTERM (a training run checkpoints at its next step, as a stopped `lm train` does;
any other job ends at once), the rest are not started, and run_jobs raises Stopped once they have ended. A second
Ctrl-C is passed on as one, which stops a training run at once. Without this the workers would outlive the process."""

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lm.util.errors import UserError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
POLL_SECONDS = 0.2  # how soon a stop request noted by the handler reaches the workers


class Stopped(Exception):
    """A stop on request. run_jobs raises it once the jobs it stopped have ended (run again to continue); a job
    raises it to say that it stopped on request itself (lm compare ladder's training runs, after their checkpoint),
    which stops the others too."""


class NotStarted(Exception):
    """A job left unstarted because the run is stopping."""


_noted: list[int] = []  # the stop signals this process has had while jobs ran
_in_job = False  # a job runs in this process: a stop signal ends it (training takes them over while it trains)
_stopping = None  # a worker's: the run's stop flag (a multiprocessing Event)


def _on_stop(signum: int, frame) -> None:
    global _in_job
    _noted.append(signum)
    if _in_job:  # once: a second signal must not interrupt the first one's unwinding
        _in_job = False
        raise Stopped(f"{signal.Signals(signum).name} while it ran")


@contextlib.contextmanager
def stop_signals_noted() -> Iterator[list[int]]:
    """While jobs run: the stop signals to this process, noted and acted on (a job running here ends), rather than
    their default action. Only the main thread can take signals; elsewhere this notes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    _noted.clear()
    previous = {sig: signal.signal(sig, _on_stop) for sig in STOP_SIGNALS}
    try:
        yield _noted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def guarded(job: Callable[[], Any]) -> Any:
    """Run `job` unless the run is stopping; a stop signal meanwhile ends it (raising Stopped)."""
    global _in_job
    if _stopping is not None and _stopping.is_set():
        raise NotStarted()
    outer, _in_job = _in_job, True  # outer: a job that runs jobs here
    try:
        return job()
    finally:
        _in_job = outer


def start_worker(threads: int, stopping) -> None:
    """A worker's initializer: stop signals end the job it runs (none between jobs: the run's stop flag then keeps the
    next from starting); its threads set, unless the run is stopping already."""
    global _stopping
    _stopping = stopping
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop)
    if not stopping.is_set():
        set_threads(threads)


def set_threads(threads: int) -> None:
    """This process's torch threads (and OpenMP's, for a torch not imported yet): a worker's initializer."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def logged(job: Callable[[], Any], log: Path) -> Any:
    """Run `job` with this process's stdout and stderr sent to `log` for good (a worker that runs one job)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask, as open() gives
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
    started (the running ones end first). A stop request raises Stopped (see the module's docstring).
    """
    if logs is None and (workers <= 1 or len(jobs) <= 1):
        return run_here(jobs, done)

    from concurrent.futures import FIRST_COMPLETED, CancelledError, ProcessPoolExecutor, wait
    from functools import partial
    from multiprocessing import get_context

    results, stopped, not_started = {}, [], []
    context = get_context("spawn")
    stopping = context.Event()
    fresh = {"max_tasks_per_child": 1} if logs is not None else {}
    with stop_signals_noted() as noted, ProcessPoolExecutor(workers, mp_context=context, initializer=start_worker,
                                                            initargs=(threads, stopping), **fresh) as pool:
        processes = pool._processes  # pid -> process, kept up to date by the pool: those to pass a stop on to
        futures = {pool.submit(partial(guarded, partial(logged, job, logs[name]) if logs is not None else job)): name
                   for name, job in jobs.items()}
        pending, acted_on = set(futures), 0  # acted_on: how many of the noted signals have been passed on
        while pending:
            ended, pending = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
            for future in ended:
                name = futures[future]
                try:
                    results[name] = future.result()
                except (NotStarted, CancelledError):
                    not_started.append(name)
                    continue
                except Exception as err:
                    if not (isinstance(err, Stopped) or noted or stopping.is_set()):
                        pool.shutdown(cancel_futures=True)
                        raise failure(name, err, logs[name] if logs is not None else None) from cause(err)
                    stopped.append(name)  # it stopped on request, or the stop ended it
                    continue
                if done:
                    done(name, results[name])
            if (noted or stopped) and not stopping.is_set():  # the first stop: the running jobs stop, no other starts
                stopping.set()
                for future in pending:
                    future.cancel()  # those still queued here (not the ones a worker has taken: the flag skips them)
                signal_all(processes, signal.SIGTERM)
                acted_on = min(1, len(noted))
            if signal.SIGINT in noted[acted_on:]:  # Ctrl-C during the stop: passed on, a training run stops at once
                signal_all(processes, signal.SIGINT)
            acted_on = max(acted_on, len(noted))
    if stopped or not_started:
        raise Stopped(stop_summary(noted, stopped, not_started))
    return {name: results[name] for name in jobs}


def run_here(jobs: dict[str, Callable[[], Any]], done: Callable[[str, Any], None] | None) -> dict[str, Any]:
    """run_jobs with one worker: the jobs in this process, one after another. A stop request ends the running job (a
    training run checkpoints first) and starts no other."""
    results = {}
    with stop_signals_noted() as noted:
        for i, (name, job) in enumerate(jobs.items()):
            try:
                results[name] = guarded(job)
            except Stopped:
                raise Stopped(stop_summary(noted, [name], list(jobs)[i + 1:])) from None
            except Exception as err:
                raise failure(name, err, None) from cause(err)
            if done:
                done(name, results[name])
            if noted:
                raise Stopped(stop_summary(noted, [], list(jobs)[i + 1:]))
    return results


def signal_all(processes: dict, sig: int) -> None:
    for process in list(processes.values()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)


def stop_summary(noted: list[int], stopped: list[str], not_started: list[str]) -> str:
    how = f" ({signal.Signals(noted[0]).name})" if noted else ""
    parts = [f"{len(stopped)} running job(s) stopped ({', '.join(stopped)})"] if stopped else []
    parts += [f"{len(not_started)} not started"] if not_started else []
    return f"stopped on request{how}: {', '.join(parts) or 'no job left'}; run the command again to continue"

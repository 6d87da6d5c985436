"""A stop request: SIGUSR1 or SIGTERM, a scheduler's preemption notice or time limit. `lm train` listens from its
first line, because a notice can come while Python is still importing torch, and there the default action would
kill the process with no checkpoint. callbacks.graceful_stop acts on the request at the next optimizer step. This module
imports nothing heavy, so the CLI can start listening before anything else."""

import signal

STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request, with a checkpoint; run again to continue
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_requested = False


class StoppedForRequeue(Exception):
    """`lm train` stopped on request after checkpointing; the CLI exits with STOPPED_EXIT_CODE."""


def _note(signum, frame):
    global _requested
    _requested = True  # no I/O in a signal handler: the step boundary does the work


def listen() -> dict:
    """Note SIGUSR1 / SIGTERM from now on; returns the handlers they replace."""
    return {sig: signal.signal(sig, _note) for sig in SIGNALS}


def ignore() -> None:
    """Ignore SIGUSR1 / SIGTERM from now on: `lm train` has finished (complete, or stopped with a checkpoint), so a
    late notice has nothing left to stop. Without this, one that came while the interpreter shuts down would kill the
    process by the signal (Python restores the default action of every signal it handled), and a job script would
    see neither 0 nor STOPPED_EXIT_CODE."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def requested() -> bool:
    return _requested


def clear() -> None:
    global _requested
    _requested = False

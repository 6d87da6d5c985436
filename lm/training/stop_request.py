"""A stop request: SIGUSR1, SIGTERM or SIGINT (a scheduler's preemption notice or time limit, `timeout`, Ctrl-C),
sent to `lm train` alone or to its whole process group (SLURM signals every process of a job step; a terminal's
Ctrl-C and `timeout` signal the group).

The signals are blocked in the process and taken by one thread waiting for them (`signal.sigwait`), so that:
- they are seen at any moment, even while the main thread waits in C (a distributed rendezvous, torch's import);
- the processes this one starts, data-loader workers among them, inherit them blocked: a group signal does not kill
  a worker, and the main process alone decides (lm's own ranks, started as `lm train` too, listen for themselves);
- Lightning's own handlers never see them (its SIGTERM handler would end training at once, without a checkpoint).

Before training starts (`arm`), a request ends the process at once: nothing to save, one line, STOPPED_EXIT_CODE.
After, it is noted: callbacks.graceful_stop checkpoints at the next optimizer step and `lm train` exits with
STOPPED_EXIT_CODE. The ranks of a run arm one after the other, so they then `agree`: a request that came while they
armed (a rank that took it before arming has ended already) ends every rank at once, as before training; and a rank
that noted one and waits for an agreement that does not come (its peer is gone) ends at once after ARMING_WAIT_S.
A second notice changes nothing, unless it is a Ctrl-C: that stops at once, without a checkpoint
(INTERRUPTED_EXIT_CODE). This module imports nothing heavy, so the CLI can start listening before anything else.
"""

import os
import signal
import sys
import threading
import time

STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request (with a checkpoint once training ran); run again to continue
INTERRUPTED_EXIT_CODE = 130  # a Ctrl-C after a first notice: stopped at once
SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
ARMING_WAIT_S = 10.0  # the ranks agree within moments of arming (they arm after a barrier); longer: a rank is gone

_requested = False
_first: str | None = None  # the first request's signal
_armed = False  # training has started on this rank: a request is noted, not acted on at once
_agreed = False  # every rank has armed, and none had a request before: a request stops at the next step
_finished = False  # training is over: a late request has nothing left to stop
_listener: threading.Thread | None = None
_ending = threading.RLock()  # re-entered by a signal handler in the main thread (handle_here)


class StoppedForRequeue(Exception):
    """`lm train` stopped on request after checkpointing; the CLI exits with STOPPED_EXIT_CODE."""


def is_rank_zero() -> bool:
    """Whether this process is global rank 0 (the one that speaks), from what launchers set in the environment."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def _say(line: str) -> None:
    if is_rank_zero():
        print(f"lm train: {line}", file=sys.stderr, flush=True)


def stop_before_training(name: str) -> None:
    """End the process at once: nothing to save, one line, STOPPED_EXIT_CODE (once, whichever thread comes first)."""
    with _ending:
        _say(f"{name} before the first step: stopped at once, nothing to save; run again to start")
        os._exit(STOPPED_EXIT_CODE)


def _on(signum: int) -> None:
    global _requested, _first
    name = signal.Signals(signum).name
    if _finished:
        return
    if not _armed:
        stop_before_training(name)
    if _requested:
        if signum == signal.SIGINT:
            _say(f"{'Ctrl-C again' if _first == 'SIGINT' else f'Ctrl-C after {_first}'}: stopped at once, without a "
                 "checkpoint of this step")
            os._exit(INTERRUPTED_EXIT_CODE)
        if _agreed:
            _say(f"{name} as well: still stopping at the next step with a checkpoint")
        return
    _requested, _first = True, name
    if _agreed:  # read after _requested is set, as agree() reads them the other way round: one of the two says it
        _announce()
    else:  # while the ranks arm: they agree in a moment, unless one is gone
        threading.Thread(target=_unless_agreed, name="lm-stop-arming", daemon=True).start()


def _announce() -> None:
    again = " (Ctrl-C again stops at once, without one)" if _first == "SIGINT" else ""
    _say(f"{_first}: stopping at the next step with a checkpoint{again}")


def _unless_agreed() -> None:
    deadline = time.monotonic() + ARMING_WAIT_S
    while not _agreed and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _agreed:
        stop_before_training(_first)


def _wait() -> None:
    while True:
        _on(signal.sigwait(SIGNALS))


def listen() -> None:
    """Take SIGUSR1 / SIGTERM / SIGINT from now on, in the listener thread. Call it first thing in the process, from
    the main thread, before any other thread exists: a thread started earlier would not block them, and the kernel
    could hand it one, whose default action ends the process."""
    global _listener, _finished
    _finished = False
    if listening():
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    _listener = threading.Thread(target=_wait, name="lm-stop-listener", daemon=True)
    _listener.start()


def listening() -> bool:
    return _listener is not None and _listener.is_alive()


def handle_here() -> dict:
    """For a caller in Python that trains in its own process (a test, a notebook), where other threads already run:
    Python handlers in the main thread instead of the listener; returns the handlers they replace (for `restore`)."""
    return {sig: signal.signal(sig, lambda signum, frame: _on(signum)) for sig in SIGNALS}


def restore(previous: dict) -> None:
    """Put back the handlers `handle_here` replaced; training is over."""
    global _armed, _agreed
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    _armed = _agreed = False


def arm() -> None:
    """Training is starting on this rank: from now on a request is noted rather than acted on at once."""
    global _armed
    _armed = True


def agree(stop: bool) -> None:
    """Every rank has armed (callbacks.graceful_stop); `stop`: one of them had a request by then. Then every rank
    ends at once, as before training (rank 0 names its request, or another's); else from now on a request stops at the
    next step with a checkpoint."""
    global _agreed
    if stop:
        stop_before_training(_first or "another process's stop request")
    _agreed = True
    if _requested:  # came in between
        _announce()


def ignore() -> None:
    """`lm train` has finished (complete, or stopped with a checkpoint): a late notice has nothing left to stop, and
    stays blocked until the process exits (it must not kill it by the signal while the interpreter shuts down)."""
    global _finished
    _finished = True


def requested() -> bool:
    return _requested


def clear() -> None:
    global _requested, _first
    _requested, _first = False, None


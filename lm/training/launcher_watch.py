"""A rank that a launcher started ends when its launcher has gone, instead of waiting for it for ever.

Lightning starts a run's other ranks on a machine as `lm train` again (its subprocess launcher, LOCAL_RANK 1 and up;
torchrun does the same) and ends them all when one dies. Nothing watched the other way: a rank whose launcher was
killed slept where it was (in torch's extension build lock, a rendezvous, a collective) for as long as 48 minutes. So
such a rank watches its parent from a thread, and ends when the parent has gone (the kernel then gives the orphan
another parent, init or a subreaper, so its parent's pid changes) and it has not ended by itself soon after. This
module imports nothing heavy.
"""

import os
import signal
import sys
import threading
import time

CHECK_EVERY_S = 1.0
# At the end of a run the ranks leave within moments of each other, rank 0 (the launcher) often first: a rank that
# has not ended GRACE_S after its launcher is one that waits.
GRACE_S = 10.0
LAUNCHER_GONE_EXIT_CODE = 1

_watcher: threading.Thread | None = None


def started_by_launcher(env=os.environ) -> bool:
    """A rank that a launcher on this machine started: LOCAL_RANK set above 0."""
    return env.get("LOCAL_RANK", "0").strip() not in ("", "0")


def _watch(parent: int) -> None:
    # The stop signals stay with the thread that takes them (lm.training.stop_request), whatever this one inherited.
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT))
    while os.getppid() == parent:
        time.sleep(CHECK_EVERY_S)
    time.sleep(GRACE_S)
    try:
        print(f"lm train: rank {os.environ.get('LOCAL_RANK')} (process {os.getpid()}): its launcher (process "
              f"{parent}) has ended; ending too", file=sys.stderr, flush=True)
    except OSError:  # its stderr may have gone with the launcher
        pass
    os._exit(LAUNCHER_GONE_EXIT_CODE)


def watch_launcher(env=os.environ) -> None:
    """From now on, this process ends when its launcher does, if a launcher started it (once per process)."""
    global _watcher
    if not started_by_launcher(env) or (_watcher is not None and _watcher.is_alive()):
        return
    _watcher = threading.Thread(target=_watch, args=(os.getppid(),), name="lm-launcher-watch", daemon=True)
    _watcher.start()

"""A rank that a launcher started (LOCAL_RANK above 0) ends when its launcher has gone, instead of sleeping where it
waits (lm.training.launcher_watch). The processes are the point here: a launcher that starts a rank which waits for
ever, as one waits in a build lock or a rendezvous; the launcher is killed; the rank ends."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lm.training.launcher_watch import started_by_launcher

# The rank: watches its launcher as lm's ranks do (lm.training.strategy.build_strategy), says so, then waits.
RANK = """
import sys, time
from lm.training.launcher_watch import watch_launcher
watch_launcher()
print("waiting", flush=True)
time.sleep(600)
"""
# The launcher: starts the rank with LOCAL_RANK 1, as Lightning's launcher does, says its pid, then waits for it.
LAUNCHER = f"""
import os, subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", {RANK!r}], env={{**os.environ, "LOCAL_RANK": "1"}},
                        stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
assert rank.stdout.readline() == "waiting\\n"
print(rank.pid, flush=True)
rank.wait()
"""


def ended(pid: int) -> bool:
    """Gone, or a zombie that its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_rank_ends_when_its_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    rank = int(launcher.stdout.readline())
    launcher.kill()  # as a stop ends it (os._exit), or the OOM killer
    launcher.wait()
    deadline = time.monotonic() + 60  # it ends about 11 s after; the limit only keeps a failure from waiting 10 min
    while not ended(rank) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert ended(rank), "the rank still waits after its launcher was killed"
    finally:
        if not ended(rank):
            os.kill(rank, signal.SIGKILL)
    said = launcher.stderr.read()
    assert f"rank 1 (process {rank}): its launcher (process {launcher.pid}) has ended; ending too" in said, said


def test_only_the_ranks_a_launcher_started_watch():
    assert started_by_launcher({"LOCAL_RANK": "1"}) and started_by_launcher({"LOCAL_RANK": "3"})
    # the process a user started, and rank 0, which Lightning's launcher runs in; SLURM's tasks have no LOCAL_RANK
    assert not any(started_by_launcher(env) for env in ({}, {"LOCAL_RANK": "0"}, {"SLURM_PROCID": "1"}))

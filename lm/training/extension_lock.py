"""Torch's extension build lock, checked before DeepSpeed starts, so that no run waits on it in silence.

DeepSpeed builds its C++ ops through torch.utils.cpp_extension.load: on a CPU machine its shared-memory all-reduce
(`deepspeed_shm_comm`) at every start of its process group, on any machine CPU Adam for an offloaded optimizer. The
loader holds a lock file, `lock` in the op's build folder (torch.utils.file_baton.FileBaton: created with O_EXCL,
empty, kept open while ninja runs, removed after), and every process that loads the op takes it, even when ninja finds
nothing to build: torch's record of what it built lives in the process, so a fresh one runs ninja again. A process
killed while it holds the lock (SIGKILL, or `os._exit` on a stop before training) leaves the file, and every later
start then waits on it for ever without a word (docs/install.md, "DeepSpeed's C++ op").

Live or stale. The lock names no holder, so the holder is looked for in /proc: a process on this machine that has the
lock file open (the loader, for the whole build) or that runs in its folder (ninja and the compilers it started, which
outlive a killed loader and finish their objects). Either one: a live build, waited for with a line every
PROGRESS_EVERY_S up to BUILD_WAIT_S. Neither, twice in a row a poll apart (the loader closes the file just before it
removes it): stale, and the command ends in one line that names the file and says it is safe to remove. /proc cannot
see another machine's processes: where machines share the folder, the line says to check that none builds there.
"""

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lm.util.errors import UserError

BUILD_WAIT_S = 1800.0  # DeepSpeed's op takes about 35 s on 2 idle cores, 9 min was seen on 2 busy ones
PROGRESS_EVERY_S = 15.0  # a wait longer than a poll or two is said at once, then this often
POLL_S = 0.5


def extensions_root() -> Path:
    """Where torch.utils.cpp_extension builds: $TORCH_EXTENSIONS_DIR itself, else a folder per Python version and
    accelerator under ~/.cache/torch_extensions (torch's _get_build_directory names it so)."""
    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    version = torch.version
    accelerator = (f"rocm{version.hip.replace('.', '')}" if version.hip else
                   f"cu{version.cuda.replace('.', '')}" if version.cuda else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def build_locks(root: Path) -> list[Path]:
    """The lock file of every op build folder under root that has one."""
    return sorted(root.glob("*/lock"))


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:  # gone, or another user's process
        return None


def lock_holders(lock: Path) -> dict[int, str]:
    """{pid: command name} of the processes on this machine that hold `lock` open or run in its folder."""
    target, folder = str(lock.resolve()), str(lock.parent.resolve())
    holders = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        cwd = _link(f"/proc/{entry.name}/cwd")
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
        except OSError:
            fds = []
        in_folder = cwd is not None and (cwd == folder or cwd.startswith(folder + os.sep))
        if in_folder or any(_link(f"/proc/{entry.name}/fd/{fd}") == target for fd in fds):
            try:
                holders[int(entry.name)] = Path(f"/proc/{entry.name}/comm").read_text().strip()
            except OSError:
                continue
    return holders


def _named(holders: dict[int, str]) -> str:
    return ", ".join(f"{pid} ({name})" for pid, name in sorted(holders.items()))


def say_on_stderr(line: str) -> None:
    print(f"lm train: {line}", file=sys.stderr, flush=True)


def wait_for_builds(root: Path | None = None, limit_s: float = BUILD_WAIT_S,
                    say: Callable[[str], None] = say_on_stderr) -> None:
    """Returns once no op build folder under root (extensions_root()) holds a lock. A lock that no process here holds
    or builds behind is a UserError that names it; a live build is waited for, and said, at most limit_s."""
    if not os.path.isdir("/proc"):  # nothing to tell a live build by (DeepSpeed's CPU op builds on Linux alone)
        return
    root = extensions_root() if root is None else root
    start, said, unheld = time.monotonic(), None, set()
    while locks := build_locks(root):
        waiting = {}
        for lock in locks:
            holders = lock_holders(lock)
            if holders:
                waiting[lock] = holders
            elif lock in unheld and lock.exists():
                raise UserError(f"{lock} is left from a build that was killed (no process on this machine holds it "
                                f"or builds in {lock.parent}), and DeepSpeed would wait on it for ever: it is safe "
                                f"to remove (rm {lock}), unless another machine that shares that folder is building "
                                "there now")
        unheld = set(locks) - set(waiting)
        waited = time.monotonic() - start
        if waiting and waited >= limit_s:
            lock, holders = next(iter(waiting.items()))
            raise UserError(f"waited {waited:.0f} s for the build in {lock.parent} (process {_named(holders)}) "
                            f"to release {lock}: if it is stuck, end those processes and remove the lock")
        if waiting and waited >= 2 * POLL_S and (said is None or waited - said >= PROGRESS_EVERY_S):
            lock, holders = next(iter(waiting.items()))
            say(f"waiting for the build of {lock.parent.name} (process {_named(holders)}) to release {lock}: "
                f"{waited:.0f} s so far, at most {limit_s / 60:.0f} min")
            said = waited
        time.sleep(POLL_S)

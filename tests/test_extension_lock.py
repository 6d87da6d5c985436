"""Torch's extension build lock before DeepSpeed starts (lm.training.extension_lock): none lets it start; one that no
process on this machine holds ends the command in one line that names it; one a live build holds (torch's own
FileBaton, or a compiler in its folder) is waited for, said, and given up at a limit. And a stale lock planted in a
temporary extensions cache, as a killed build leaves it, ends a 2-process DeepSpeed `lm train` in one line."""

import os
import subprocess
from pathlib import Path

import pytest
from strategy_runs import STRATEGIES, base_config, environment, lm_command
from torch.utils.file_baton import FileBaton

from lm.training.extension_lock import build_locks, lock_holders, wait_for_builds
from lm.util.errors import UserError

OP = "deepspeed_shm_comm"


def killed_build(root: Path) -> Path:
    """An op's build folder as a build killed while it compiled leaves it: torch's build.ninja written, no objects
    yet, and the empty lock file that its loader would have removed."""
    folder = root / OP
    folder.mkdir(parents=True)
    (folder / "build.ninja").write_text(
        "ninja_required_version = 1.3\ncxx = c++\n\nrule compile\n  command = $cxx -MMD -MF $out.d $cflags -c $in -o "
        "$out\n\nrule link\n  command = $cxx $in $ldflags -o $out\n\nbuild shm.o: compile shm.cpp\n"
        f"build {OP}.so: link shm.o\n\ndefault {OP}.so\n")
    (folder / "lock").touch()
    return folder / "lock"


def test_without_a_lock_deepspeed_starts(tmp_path):
    wait_for_builds(tmp_path)  # no op built yet
    (tmp_path / OP).mkdir()
    (tmp_path / OP / f"{OP}.so").touch()
    wait_for_builds(tmp_path)  # an op built, its lock removed


def test_a_lock_that_no_process_holds_ends_in_one_line(tmp_path):
    lock = killed_build(tmp_path)
    assert lock_holders(lock) == {}
    with pytest.raises(UserError) as refused:
        wait_for_builds(tmp_path)
    line = str(refused.value)
    assert "\n" not in line and f"{lock} is left from a build that was killed" in line
    assert f"it is safe to remove (rm {lock})" in line


def test_a_lock_that_a_live_build_holds_is_waited_for_and_said(tmp_path):
    """torch's own FileBaton holds the lock here, as its loader does while ninja runs; it is released (closed and
    removed, as torch does) once the wait has been said."""
    lock = tmp_path / OP / "lock"
    lock.parent.mkdir()
    baton = FileBaton(str(lock))
    assert baton.try_acquire()
    assert set(lock_holders(lock)) == {os.getpid()}
    said = []
    wait_for_builds(tmp_path, say=lambda line: (said.append(line), baton.release()))
    assert len(said) == 1 and said[0].startswith(f"waiting for the build of {OP} (process {os.getpid()} (")
    assert str(lock) in said[0] and "at most 30 min" in said[0]
    assert build_locks(tmp_path) == []


def test_the_compilers_of_a_killed_loader_are_a_live_build_up_to_the_limit(tmp_path, monkeypatch):
    """The loader gone, ninja and its compilers still run in the build folder (this process stands in for them):
    waited for, and given up at the limit in one line that names them."""
    lock = killed_build(tmp_path)
    monkeypatch.chdir(lock.parent)
    assert set(lock_holders(lock)) == {os.getpid()}
    with pytest.raises(UserError) as refused:
        wait_for_builds(tmp_path, limit_s=0)
    line = str(refused.value)
    assert f"for the build in {lock.parent} (process {os.getpid()} (" in line and f"to release {lock}" in line


def test_a_stale_lock_ends_a_deepspeed_launch_in_one_line(kjv_data, tmp_path):
    """Two DeepSpeed ranks on the CPU with a killed build's lock in their extensions cache: without the check, they
    waited for it for ever (torch's FileBaton); with it, `lm train` ends before a rank starts, in one line."""
    lock = killed_build(tmp_path / "extensions")
    run_dir = tmp_path / "run"
    command = lm_command("train", "--config", str(base_config(tmp_path, kjv_data)), "--run_dir", str(run_dir),
                         *STRATEGIES["zero2"])
    environ = {**environment(), "TORCH_EXTENSIONS_DIR": str(lock.parent.parent)}
    # The limit only keeps a hang from holding the suite (a rank left then ends with its launcher).
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lm train: error:")]
    assert len(errors) == 1 and f"{lock} is left from a build that was killed" in errors[0], result.stderr[-3000:]
    assert lock.exists() and not (run_dir / "checkpoints").exists()

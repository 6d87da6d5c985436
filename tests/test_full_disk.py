"""A checkpoint that cannot be written (a full disk) ends the run in one line, with exit status 74, naming the error,
the directory and the newest whole checkpoint; the partial copy is removed; a rerun with room resumes from that
checkpoint to the weights of a run never interrupted.

On a real small filesystem (a tmpfs, mounted as root: CI runs as root) for a single file and FSDP2's shards; and
through LM_FAULTS (enospc@step:N), which fails a write once part of the file is on disk, for a single file, and on one
rank alone (@rank:R) for DDP's file (rank 0 writes it while rank 1 waits) and for DeepSpeed's shards (rank 1's fails,
rank 0's succeeds: rank 0 must not wait for rank 1 in DeepSpeed's own barrier)."""

import contextlib
import errno
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from strategy_runs import ONE_PROCESS, STRATEGIES, environment, lm_command, train_here

from lm.training.consolidate import consolidate
from lm.training.step_checkpoint import _disk_refuses
from lm.util.errors import WRITE_FAILED_EXIT_CODE

FIRST, FULL = "step=00000002.ckpt", "step=00000004.ckpt"


def train(config: Path, run_dir: Path, flags: list[str], timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """`lm train` to its end: until every rank has closed the output it shares (a rank that waits for ever fails the
    test at `timeout`, and all are killed). One process (ONE_PROCESS) runs in this one, as the command line runs it
    (main()): a launch of its own would spend most of its time importing torch and Lightning again."""
    if flags is ONE_PROCESS:
        return train_here(config, run_dir, *flags, **env)
    command = lm_command("train", "--config", str(config), "--run_dir", str(run_dir), *flags)
    process = subprocess.Popen(command, env={**environment(), **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"a rank still waits after {timeout} s:\n{process.communicate()[1][-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def assert_ends_in_one_line(result: subprocess.CompletedProcess, run_dir: Path) -> None:
    """Exit 74; the last line says it all; step 2's checkpoint is whole and step 4's partial copy is gone."""
    assert result.returncode == WRITE_FAILED_EXIT_CODE, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    checkpoints = run_dir / "checkpoints"
    assert last == (f"lm train: error: cannot write checkpoint {FULL} in {checkpoints} (No space left on device); "
                    f"the partial copy was removed; resume from {checkpoints / FIRST} once there is room"), last
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.endswith(".json")) == [FIRST]


def assert_resumes_to(run_dir: Path, config: Path, flags: list[str], uninterrupted: Path) -> None:
    result = train(config, run_dir, flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / FIRST}" in result.stderr
    ours, theirs = consolidate(run_dir / "checkpoints" / FULL)[0], consolidate(uninterrupted / "checkpoints" / FULL)[0]
    assert all(ours[k].equal(theirs[k]) for k in theirs)


def open_here(folder: Path) -> list[str]:
    """The files under folder that this process holds open."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own, closed by now
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [path for path in held if path.startswith(f"{folder}/")]


def test_an_injected_full_disk_ends_in_one_line_and_resumes(strategy_runs, tmp_path):
    run = tmp_path / "run"
    result = train(strategy_runs["config"], run, ONE_PROCESS, LM_FAULTS="enospc@step:4")
    assert_ends_in_one_line(result, run)
    assert open_here(run) == []  # a caller in Python goes on: the run left nothing open (its lock file was)
    assert_resumes_to(run, strategy_runs["config"], ONE_PROCESS, strategy_runs["single"])


@pytest.mark.parametrize("name, rank", [("ddp", 0), ("zero2", 1)])
def test_a_full_disk_on_one_rank_ends_every_rank_in_one_line(name, rank, strategy_runs, tmp_path):
    """Rank 0's line names the error (the errno of the rank that failed); no rank waits for another, none says more.
    (A resume after a full disk: the tests above.)"""
    run = tmp_path / "run"
    result = train(strategy_runs["config"], run, STRATEGIES[name], timeout=240, LM_FAULTS=f"enospc@step:4@rank:{rank}")
    assert_ends_in_one_line(result, run)
    assert result.stderr.count("cannot write checkpoint") == 1, result.stderr[-3000:]


def _mount_tmpfs(where: Path, size_bytes: int) -> bool:
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


# DeepSpeed's shards go through the same writer as a single file (the injected tests' path).
@pytest.mark.parametrize("name", ["single", "fsdp2"])
def test_a_real_full_disk_ends_in_one_line_and_resumes(name, strategy_runs, tmp_path):
    """The disk holds the run and one checkpoint, not two (sized from the same run's step-2 checkpoint)."""
    flags = ONE_PROCESS if name == "single" else STRATEGIES[name]
    first = strategy_runs[name] / "checkpoints" / FIRST
    size = sum(p.stat().st_size for p in ([first] if first.is_file() else first.rglob("*")))
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, int(1.4 * size) + 256 * 1024):
        if os.environ.get("CI"):
            pytest.fail("CI runs as root and must mount a tmpfs")
        pytest.skip("mounting a tmpfs needs root")
    try:
        # One process in this one: the disk is unmounted after it, which a file the run left open would refuse.
        result = train(strategy_runs["config"], disk / "run", flags)
        assert_ends_in_one_line(result, disk / "run")
        shutil.copytree(disk / "run", tmp_path / "run")  # the run moved to a disk with room
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert_resumes_to(tmp_path / "run", strategy_runs["config"], flags, strategy_runs[name])



def test_a_save_that_failed_on_a_full_disk_is_named_as_one(tmp_path):
    """A write that fills the disk part way returns short without an errno, and torch's zip writer (DCP's shards)
    then fails with its own RuntimeError ("unexpected pos ..."): the disk is asked, and its ENOSPC is the save's."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, 4 << 20):  # room for the 1 MiB that asks
        if os.environ.get("CI"):
            pytest.fail("CI runs as root and must mount a tmpfs")
        pytest.skip("mounting a tmpfs needs root")
    try:
        with open(disk / "shard", "wb", buffering=0) as shard:
            assert shard.write(bytes(8 << 20)) < 8 << 20  # short, no errno
        error = _disk_refuses(RuntimeError("unexpected pos 704 vs 598"), disk)
        assert error is not None and error.errno == errno.ENOSPC
        assert [p.name for p in disk.iterdir()] == ["shard"]  # asking left nothing behind
        (disk / "shard").unlink()
        assert _disk_refuses(RuntimeError("unexpected pos 704 vs 598"), disk) is None  # room: not the disk's error
        assert [p.name for p in disk.iterdir()] == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)

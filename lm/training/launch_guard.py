"""Refuse a mis-launched run before it trains: a SLURM allocation whose task count does not match the strategy,
a multi-process run started inside a SLURM job without `srun`, or a run directory that another live process is
already training. Each would otherwise hang, train with the wrong world size, or interleave two runs' checkpoints.
"""

import fcntl
import json
import os
import socket
from pathlib import Path

import lightning as L

from lm.errors import UserError

LOCK_NAME = ".lm-train.lock"


def check_slurm_launch(world_size: int, env=os.environ) -> None:
    """Inside a SLURM job, the processes must come from `srun`, one per device: SLURM_NTASKS = nodes x devices."""
    if "SLURM_JOB_ID" not in env or "SLURM_NTASKS" not in env:
        return
    ntasks = int(env["SLURM_NTASKS"])
    if "SLURM_STEP_ID" not in env:  # the batch script itself, not a task that srun started
        if world_size > 1 or ntasks > 1:
            raise UserError(f"SLURM job {env['SLURM_JOB_ID']} has {ntasks} tasks and the run needs {world_size} "
                            f"processes, but lm train was started without srun: launch it with `srun lm train ...` "
                            f"(lm slurm submit does)")
        return
    if ntasks != world_size:
        raise UserError(f"SLURM_NTASKS is {ntasks} but the run needs strategy.num_nodes x strategy.devices = "
                        f"{world_size} processes: submit with --nodes=num_nodes and --ntasks-per-node=devices "
                        f"(lm slurm submit does)")


class RunDirLock(L.Callback):
    """Global rank 0 holds an exclusive lock on the run directory for the whole fit. It is a POSIX record lock
    (lockf): it dies with the process, so a killed or requeued run never leaves a stale one, forked data-loader
    workers do not inherit it, and it also holds over NFS. All ranks learn the outcome through one broadcast, so
    they fail together rather than hang."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._file = None

    def setup(self, trainer, pl_module, stage):
        holder = None
        if trainer.is_global_zero:
            self._file = open(self.path, "a+")
            try:
                fcntl.lockf(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._file.truncate(0)
                self._file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                             "slurm_job": os.environ.get("SLURM_JOB_ID")}))
                self._file.flush()
            except OSError:  # EAGAIN / EACCES: held by another process
                self._file.seek(0)
                holder = self._file.read() or "{}"
                self._file.close()
                self._file = None
        holder = trainer.strategy.broadcast(holder)
        if holder is not None:
            raise UserError(f"run_dir {self.path.parent} is being trained by another live process {holder}: "
                            f"wait for it, cancel it, or use another run_dir")

    def teardown(self, trainer, pl_module, stage):
        if self._file is not None:
            self._file.close()  # closing releases the lock
            self._file = None

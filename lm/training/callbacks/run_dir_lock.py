"""One live process trains a run directory: a second `lm train` on it is refused in one line rather than interleaving
two runs' checkpoints (lm.training.launch_guard checks the rest of a launch, before Lightning is imported)."""

import fcntl
import json
import os
import socket
from pathlib import Path

import lightning as L

from lm.training.launch_guard import LOCK_NAME
from lm.util.errors import UserError


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

    def on_exception(self, trainer, pl_module, exception):
        # Lightning calls teardown only after a fit that ended well: a fit that raised (a full disk) would keep the
        # file open in a process that goes on (a caller in Python, a test), and its filesystem busy.
        self.teardown(trainer, pl_module, "fit")

"""Faults injected on purpose, so that tests can check what `lm train` does when things go wrong at a chosen moment,
with nothing else changed (not the data, not the code under test).

    LM_FAULTS="signal@checkpoint,nan_grad@3,nan_grad@4" lm train ...
    LM_FAULTS="kill@step:3" lm train ...
    LM_FAULTS="enospc@step:4@rank:1" lm train ...

- `signal@MOMENT` sends this process SIGUSR1 (a scheduler's stop notice) once, at MOMENT: `fit_start`, `step:N`
  (at the end of the first micro-batch after optimizer step N: mid-accumulation when there is any), `validation` (at
  its start), `checkpoint` (while a checkpoint is being written), `train_end` (after the last step) or `arming` (in
  the instant between the ranks' arming, lm.training.callbacks.graceful_stop: global rank 0 takes it just after it
  has armed, every other rank just before; one process takes it as it arms). `sigterm@MOMENT` sends SIGTERM (a time
  limit) instead, `sigint@MOMENT` SIGINT (Ctrl-C), and `kill@MOMENT` SIGKILL (a crash, an out-of-memory kill, a lost
  node: the process ends there, nothing of lm's runs after it). At `step:N` it comes before step N's checkpoint is
  written (Lightning runs checkpoint callbacks last): `kill@step:3` with a checkpoint every 2 steps leaves step 2's
  newest. (The interpreter's own shutdown comes after anything here could run: tests send those notices from
  outside.)
- `enospc@step:N` makes the checkpoint written at step N fail with ENOSPC once part of it is on disk, as a disk that
  fills up would: single files and DeepSpeed's shards (both written by lm.training.checkpoint_io.stream_save).
  FSDP2's shards are written by torch.distributed.checkpoint itself: test them on a small real disk.
- `nan_grad@N` makes every gradient of optimizer step N (0-based, the trainer's global_step then) NaN, as a
  diverging step would.

A fault happens on every rank, unless `@rank:R` follows it: then on global rank R alone (a disk that fills on one
node, a notice that reaches one process). Unset, nothing is added to the Trainer.
"""

import errno
import os
import signal
import time

import lightning as L
import torch

from lm.training import stop_request
from lm.training.checkpoint_io import fail_next_save
from lm.util.errors import UserError

ENV = "LM_FAULTS"
MOMENTS = ("fit_start", "validation", "checkpoint", "train_end", "arming")
SIGNALS = {"signal": signal.SIGUSR1, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "kill": signal.SIGKILL}


def _readable(kind: str, where: str) -> bool:
    step = where.startswith("step:") and where[5:].isdigit()
    return ((kind in SIGNALS and (where in MOMENTS or step)) or (kind == "nan_grad" and where.isdigit()) or
            (kind == "enospc" and step))


def planned() -> list[tuple[str, str, int | None]]:
    """(fault, where, rank or None for every rank) from LM_FAULTS; a malformed entry is an error, not a silent
    no-op."""
    faults = []
    for entry in filter(None, os.environ.get(ENV, "").split(",")):
        kind, _, where = entry.strip().partition("@")
        where, _, rank = where.partition("@rank:")
        if not _readable(kind, where) or (rank and not rank.isdigit()) or "@" in where:
            raise UserError(f"{ENV}: cannot read {entry!r} (signal@MOMENT, sigterm@MOMENT, sigint@MOMENT or "
                            f"kill@MOMENT with MOMENT in {', '.join(MOMENTS)} or step:N, nan_grad@N, or "
                            "enospc@step:N; each may end in @rank:R)")
        faults.append((kind, where, int(rank) if rank else None))
    return faults


class InjectFaults(L.Callback):
    def __init__(self, faults: list[tuple[str, str, int | None]]):
        self.faults = faults
        self.signal_at, self.nan_steps, self.full_disk_at = {}, set(), set()

    def setup(self, trainer, pl_module, stage):
        """The faults of this rank, once the ranks are known."""
        mine = [(kind, where) for kind, where, rank in self.faults if rank in (None, trainer.global_rank)]
        self.signal_at = {where: SIGNALS[kind] for kind, where in mine if kind in SIGNALS}
        self.nan_steps = {int(where) for kind, where in mine if kind == "nan_grad"}
        self.full_disk_at = {int(where[5:]) for kind, where in mine if kind == "enospc"}
        if "arming" in self.signal_at:
            stop = next(c for c in trainer.callbacks if hasattr(c, "arm"))  # callbacks.graceful_stop.GracefulStop
            arm = stop.arm

            def arm_with_a_notice():
                if trainer.global_rank:  # not armed yet: the notice ends this rank at once
                    self._signal("arming")
                arm()
                self._signal("arming")

            stop.arm = arm_with_a_notice

    def _signal(self, moment: str) -> None:
        if moment in self.signal_at:
            sig = self.signal_at.pop(moment)
            os.kill(os.getpid(), sig)
            # The listener thread takes it (lm.training.stop_request): wait until it has, so that the request is
            # noted at exactly this moment (before training, it ends the process there).
            deadline = time.monotonic() + 10
            while sig != signal.SIGKILL and not stop_request.requested() and time.monotonic() < deadline:
                time.sleep(0.001)

    def on_fit_start(self, trainer, pl_module):
        self._signal("fit_start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._signal(f"step:{trainer.global_step}")

    def on_validation_start(self, trainer, pl_module):
        self._signal("validation")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._signal("checkpoint")
        if trainer.global_step in self.full_disk_at:  # called as the checkpoint is built, just before it is written
            self.full_disk_at.discard(trainer.global_step)
            fail_next_save(errno.ENOSPC)

    def on_train_end(self, trainer, pl_module):
        self._signal("train_end")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in self.nan_steps:
            for parameter in pl_module.parameters():
                if parameter.grad is not None:
                    parameter.grad.fill_(torch.nan)

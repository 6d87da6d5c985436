"""Writing a checkpoint (the format and its readers: lm.training.checkpoint): Lightning's ModelCheckpoint, made to write
under a temporary name and rename once every rank has finished, and to end the run in one line when a write fails;
on a resume, it counts the checkpoint's micro-batches as this run's accumulation would have (recount_micro_batches).
Apart from the readers so that evaluation, export and `lm slurm status` do not import Lightning."""

import os
import shutil
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lm.training.checkpoint import CONTENTS, STEP_NAME, manifest_of, newest_checkpoint, step_checkpoints, write_manifest
from lm.util.errors import CheckpointWriteFailed


def _fsync_tree(path: Path) -> None:
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        with open(file, "rb") as f:
            os.fsync(f.fileno())


class StepCheckpoint(ModelCheckpoint):
    """Keeps the newest `keep_last` checkpoints `step=NNNNNNNN.ckpt`, every `every` steps and at the end;
    each is written under a temporary name and renamed once every rank has finished."""

    def __init__(self, dirpath: str, every: int, keep_last: int):
        super().__init__(dirpath=dirpath, filename="step={step:08d}", auto_insert_metric_name=False,
                         every_n_train_steps=every, save_top_k=keep_last, monitor="step", mode="max",
                         enable_version_counter=False)  # a step saved again replaces its old (damaged) copy

    def _save_checkpoint(self, trainer, filepath):
        final, tmp = Path(filepath), Path(str(filepath) + ".tmp")
        strategy = trainer.strategy
        if trainer.is_global_zero:
            _remove(tmp)  # left by a crash
        strategy.barrier()
        # Every rank learns of a failure on any rank, and all end together (rank 0's line says it): first of the
        # writes (each rank's shards; DeepSpeed's save goes on to its end on every rank, lm.training.strategy), then,
        # only once every rank has written, of rank 0's manifest and rename.
        error = _attempt(lambda: _write(trainer, tmp, self.save_weights_only), tmp.parent)
        failed = strategy.reduce_boolean_decision(error is not None, all=False)
        if not failed:
            if trainer.is_global_zero:
                error = _attempt(lambda: self._commit(tmp, final, trainer.global_step), tmp.parent)
            failed = strategy.reduce_boolean_decision(error is not None, all=False)
        if failed:
            self._give_up(trainer, tmp, final, error)
        strategy.barrier()
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = str(final)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0, once every rank has written `tmp`: manifest, flush to the disk, rename to `final`, prune."""
        _remove(final)  # a checkpoint of the same step saved again
        # A single file's manifest is written under its final name first: a crash before the rename leaves only
        # a manifest without its checkpoint, which nothing lists.
        write_manifest(tmp, tmp / CONTENTS if tmp.is_dir() else manifest_of(final))
        _fsync_tree(tmp)
        if tmp.is_file():
            _fsync_tree(manifest_of(final))
        os.replace(tmp, final)
        self._prune(step)

    def _give_up(self, trainer, tmp: Path, final: Path, error: OSError | None) -> None:
        """A write failed (a full disk): remove what it left, name the newest whole checkpoint, end the run."""
        if trainer.is_global_zero:
            _remove(tmp)
            if not final.exists():
                manifest_of(final).unlink(missing_ok=True)
        # This rank's error, else another's (its errno: the ranks that failed on a full disk all say ENOSPC).
        code = torch.tensor(float(getattr(error, "errno", None) or 0), device=trainer.strategy.root_device)
        code = int(trainer.strategy.reduce(code, reduce_op=torch.distributed.ReduceOp.MAX))
        trainer.strategy.barrier()
        newest = newest_checkpoint(self.dirpath, warn=False)
        reason = (f"{error.strerror or error}" if error is not None else os.strerror(code) if code else
                  "another rank's write failed")
        resume = f"resume from {newest} once there is room" if newest else "no earlier checkpoint to resume from"
        raise CheckpointWriteFailed(f"cannot write checkpoint {final.name} in {self.dirpath} ({reason}); the "
                                    f"partial copy was removed; {resume}", rank=trainer.global_rank)

    def _prune(self, step: int) -> None:
        """Keep the newest `keep_last` up to `step`. Lightning's own top-k list starts afresh at every launch, so
        it misses checkpoints that an earlier launch wrote (a graceful stop's, say). Newer ones, left by a run
        resumed from an older checkpoint, are not this branch's to delete."""
        if self.save_top_k < 1:
            return  # keep all
        older = [p for p in step_checkpoints(self.dirpath) if int(STEP_NAME.match(p.name).group(1)) <= step]
        for path in older[self.save_top_k:]:
            _remove(path)

    def save_now(self, trainer) -> None:
        """Checkpoint the current step (a graceful stop), keeping `keep_last`."""
        if self._last_global_step_saved != trainer.global_step:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer, pl_module):
        if not self._should_skip_saving_checkpoint(trainer):  # the last step, unless `every` divided it
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        recount_micro_batches(checkpoint, trainer.accumulate_grad_batches)


def recount_micro_batches(checkpoint: dict, accumulate: int) -> None:
    """The checkpoint's count of micro-batches as this run would have counted them: global_step x its accumulation.

    Lightning counts micro-batches: it steps the optimizer where its count is a multiple of the accumulation and
    validates where it is a multiple of val_check_interval (trainer.val_every x accumulation). A resume on another
    world size or micro-batch keeps the global batch with another accumulation, so the count of the run that wrote
    the checkpoint, left as it was, put this run's steps off their boundaries: after a step written with
    accumulation 1, the first step of a resume with 2 took one micro-batch, and one with val_every 2 validated at
    steps 3 and 5. Every counter moves by the same amount, so Lightning still sees where in a step it was saved."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if progress is None or "global_step" not in checkpoint:  # a checkpoint of weights alone
        return
    shift = checkpoint["global_step"] * accumulate - progress["total"]["ready"]
    for counts in (progress["total"], progress["current"]):  # one epoch: the run's windows are one stream
        for key in counts:
            counts[key] += shift


def _write(trainer, tmp: Path, weights_only: bool) -> None:
    """This rank's part of the checkpoint, into `tmp`; an error that a writer kept rather than raised is raised."""
    trainer.save_checkpoint(tmp, weights_only)  # ends with a barrier: every rank has written
    if (error := _pop_write_error(trainer.strategy)) is not None:
        raise error


def _attempt(write, directory: Path) -> OSError | None:
    """The OSError that makes `write()` fail (None: it succeeded); any other failure is raised."""
    try:
        write()
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        error = write_error_in(err) or _disk_refuses(err, directory)
        if error is None:
            raise
        return error
    return None


def _pop_write_error(strategy) -> Exception | None:
    """The error a save kept, once: a single file's OSError (lm.training.checkpoint_io.StreamingCheckpointIO), or
    that of any of DeepSpeed's writes (lm.training.strategy.StreamingDeepSpeedStrategy)."""
    for keeper in (strategy.checkpoint_io, strategy):
        error = getattr(keeper, "write_error", None)
        if error is not None:
            keeper.write_error = None
            return error
    return None


def write_error_in(err: BaseException) -> OSError | None:
    """The OSError behind a failed save, if that is what failed: raised itself, the cause of a library's error, or
    among the failures that torch.distributed.checkpoint gathers from every rank."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        for failure in getattr(err, "failures", {}).values():  # DCP's CheckpointException: rank -> exception
            found = write_error_in(failure[0] if isinstance(failure, tuple) else failure)
            if found is not None:
                return found
        err = err.__cause__ or err.__context__
    return None


def _disk_refuses(err: BaseException, directory: Path) -> OSError | None:
    """Why the disk took no more, if it did not: a write that fills a disk part way returns short without an errno,
    and torch's zip writer reports that as its own RuntimeError ("unexpected pos"), as DCP's shards do. So after a
    failed save, 1 MiB more is written beside it (before its partial copy is removed): the OSError that write meets
    (ENOSPC, EDQUOT) is the save's. None if the disk takes it, or if the save was interrupted, not failed."""
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        return None
    probe = directory / f".lm-space-probe-{os.getpid()}"
    try:
        with open(probe, "wb", buffering=0) as file:
            data = memoryview(bytes(1 << 20))
            while data:
                data = data[file.write(data):]  # a short write is retried, and the retry meets the errno
            os.fsync(file.fileno())
    except OSError as probe_error:
        return probe_error
    finally:
        probe.unlink(missing_ok=True)
    return None


def _remove(path: Path) -> None:
    """A checkpoint, with the manifest beside it if it is a file."""
    if path.is_dir():
        shutil.rmtree(path)
        return
    path.unlink(missing_ok=True)
    manifest_of(path).unlink(missing_ok=True)

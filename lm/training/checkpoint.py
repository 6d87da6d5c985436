"""Checkpoints that are complete or absent, whatever the strategy wrote (a file, or a directory of shards).

Every rank writes into `step=N.ckpt.tmp`; once all have finished, rank 0 records what was written, each file's size
and sha256, in a manifest (`lm-checkpoint.json` inside a directory of shards; `step=N.ckpt.lm-checkpoint.json`
beside a single file), flushes it to disk and renames the checkpoint to `step=N.ckpt`. So a checkpoint under its final
name was complete when written; `checkpoint_problem` checks that every byte is still what was written before a resume,
an export or an evaluation uses it.
"""

import json
import os
import re
import shutil
import sys
import zipfile
import zlib
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lm.data_prep.shards import sha256_file
from lm.training.data_only import require_data_only
from lm.util.errors import CheckpointWriteFailed, UserError

STEP_NAME = re.compile(r"^step=(\d+)\.ckpt$")
CONTENTS = "lm-checkpoint.json"


def _fsync_tree(path: Path) -> None:
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        with open(file, "rb") as f:
            os.fsync(f.fileno())


def manifest_of(path: Path) -> Path:
    """Where the manifest of the checkpoint at `path` is (or goes): inside a directory, beside a file."""
    return path / CONTENTS if path.is_dir() else path.with_name(f"{path.name}.{CONTENTS}")


def write_manifest(checkpoint: Path, manifest: Path) -> None:
    """Size and sha256 of every file of `checkpoint` (a file: one entry, named "")."""
    files = [checkpoint] if checkpoint.is_file() else sorted(p for p in checkpoint.rglob("*") if p.is_file())
    entries = {("" if f == checkpoint else str(f.relative_to(checkpoint))): {"size": f.stat().st_size,
                                                                             "sha256": sha256_file(f)} for f in files}
    manifest.write_text(json.dumps({"files": entries}, indent=1))


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


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint at `path` cannot be used (None if it is whole): every file its manifest lists must be
    there with the recorded size and sha256. A file without a manifest (written before lm kept them) must be a
    readable torch zip whose every member matches the CRC-32 torch's writer recorded for it (torch.load itself does
    not check them: a flipped byte in a tensor would load as another number); a directory without one is
    incomplete."""
    path = Path(path)
    if not path.exists():
        return f"{path} not found"
    manifest = manifest_of(path)
    if path.is_file() and not manifest.is_file():
        try:
            with zipfile.ZipFile(path) as archive:
                damaged = archive.testzip()  # reads every member and checks its CRC-32: the first bad one's name
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as err:
            return f"{path} is not a readable checkpoint ({' '.join(str(err).split())})"
        if damaged is not None:
            return f"{path} is damaged ({damaged} does not match the CRC-32 written with it)"
        return None
    if not manifest.is_file():
        return f"{path} is incomplete (no {CONTENTS})"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as err:
        return f"{manifest} is unreadable ({err})"
    for name, recorded in files.items():
        file = path / name if name else path
        size, sha256 = (recorded, None) if isinstance(recorded, int) else (recorded["size"], recorded["sha256"])
        if not file.is_file():
            return f"{path} is missing {name}"
        if file.stat().st_size != size:
            return f"{path}: {name or 'the file'} has {file.stat().st_size} bytes, {size} were written"
        if sha256 is not None and sha256_file(file) != sha256:
            return f"{path}: {name or 'the file'} is damaged (its sha256 is not the one written)"
    return None


def step_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoints `step=N.ckpt` in `directory`, newest first (temporary ones are ignored)."""
    found = [(int(m.group(1)), p) for p in Path(directory).glob("step=*.ckpt") if (m := STEP_NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def newest_checkpoint(directory: str | Path, warn: bool = True) -> Path | None:
    """The newest usable checkpoint in `directory`; damaged newer ones are skipped with a warning on stderr."""
    for path in step_checkpoints(directory):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if warn:
            print(f"lm: warning: skipping checkpoint {problem}", file=sys.stderr)
    return None


def require_usable(path: str | Path) -> Path:
    """`path` if it is a usable checkpoint, else a UserError saying why."""
    problem = checkpoint_problem(path)
    if problem:
        raise UserError(f"checkpoint {problem}")
    return Path(path)


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory holding a checkpoint (run_dir/checkpoints/step=N.ckpt) or the directory itself."""
    path = Path(checkpoint)
    if path.is_dir() and not STEP_NAME.match(path.name):
        return path
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint path, or a run directory's newest checkpoint; whole, and holding nothing but data
    (lm.training.data_only), checked before the caller reads or writes anything."""
    found = _whole_checkpoint(path)
    require_data_only(found)
    return found


def _whole_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir() and not STEP_NAME.match(path.name) and not (path / CONTENTS).exists():
        found = newest_checkpoint(path / "checkpoints") or newest_checkpoint(path)
        if found is None:
            raise UserError(f"no checkpoint in {path}")
        return found
    if not path.exists():
        raise UserError(f"checkpoint {path} not found")
    return require_usable(path)


def load_model(path: str | Path, map_location: str = "cpu"):
    """(LanguageModel in eval mode, hyperparameters) from a checkpoint of any strategy, or a run directory."""
    from lm.model import LanguageModel, LMConfig
    from lm.training.consolidate import consolidate

    state_dict, hparams = consolidate(resolve_checkpoint(path))
    model = LanguageModel(LMConfig(**hparams["model"]))
    model.load_state_dict(state_dict)
    return model.to(map_location).eval(), hparams


def tokenizer_path(checkpoint: str | Path) -> Path:
    """tokenizer.json of an `lm export` directory (either format), or of the run a checkpoint (or run directory)
    belongs to."""
    path = Path(checkpoint)
    if not path.exists():
        raise UserError(f"checkpoint {checkpoint} not found")
    exported = (path / "model.safetensors").is_file() or (path / "config.json").is_file()
    tokenizer = path / "tokenizer.json" if exported else run_dir_of(checkpoint) / "tokenizer.json"
    if not tokenizer.is_file():
        raise UserError(f"no tokenizer.json beside the checkpoint (looked for {tokenizer})")
    return tokenizer


def load_with_tokenizer(checkpoint: str | Path):
    """(LanguageModel in eval mode, tokenizers.Tokenizer) from a checkpoint, a run directory or an `lm export`
    directory of either format."""
    from tokenizers import Tokenizer

    from lm.model import LanguageModel

    tokenizer = Tokenizer.from_file(str(tokenizer_path(checkpoint)))
    if (Path(checkpoint) / "config.json").is_file():
        return LanguageModel.from_pretrained(str(checkpoint)), tokenizer
    return load_model(checkpoint)[0], tokenizer

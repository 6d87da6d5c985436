"""How a single-file checkpoint (single device, DDP) is written and read.

Lightning's own TorchCheckpointIO serialises the whole checkpoint into memory and stages it in the system temp
directory before copying it into place: a 1B model's 12 GB with AdamW's states would cost that much more host memory
on rank 0, and as much again in a node's temp directory, which is often small or held in RAM. lm writes under a
temporary name beside the final one and renames it once whole (lm.training.step_checkpoint), so that staging buys
nothing: here torch.save streams straight into the file Lightning names. Reading is data only
(lm.training.data_only).
"""

import errno
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lm.training import data_only

# Tests only (LM_FAULTS=enospc@step:N, lm.training.callbacks.faults): the errno that the next stream_save's second
# write fails with, once part of the file is on disk, as on a disk that fills up while a checkpoint is written.
_injected_errno: int | None = None


def fail_next_save(code: int = errno.ENOSPC) -> None:
    global _injected_errno
    _injected_errno = code


class _KeepWriteError:
    """A file that remembers the OSError of a failed write: torch's writer reports a failed write as its own
    RuntimeError, and the OSError (ENOSPC, EIO, EDQUOT) is what the caller must act on."""

    def __init__(self, file):
        self.file, self.error, self.writes = file, None, 0

    def write(self, data) -> int:
        global _injected_errno
        try:
            if _injected_errno is not None and self.writes:
                code, _injected_errno = _injected_errno, None
                raise OSError(code, os.strerror(code))
            self.writes += 1
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def stream_save(obj: Any, path: str | Path) -> None:
    """torch.save(obj) straight into `path`, flushed to the disk; an OSError while writing raises that OSError."""
    with open(path, "wb") as raw:
        sink = _KeepWriteError(raw)
        try:
            torch.save(obj, sink)
            raw.flush()
            os.fsync(raw.fileno())
        except Exception as err:
            if sink.error is not None:
                raise sink.error from err
            raise


class StreamingCheckpointIO(TorchCheckpointIO):
    """Lightning's CheckpointIO for single files: one streamed write, no copy in memory or in the temp directory;
    weights-only reads. A failed write removes its partial file and is kept in `write_error` rather than raised:
    under DDP only rank 0 writes, and the others wait for it at Lightning's barrier; lm.training.checkpoint then
    tells every rank."""

    write_error: OSError | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("lm's checkpoint writer takes no storage_options")
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            stream_save(checkpoint, path)
        except OSError as err:
            Path(path).unlink(missing_ok=True)
            self.write_error = err

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        return data_only.load(path, map_location=map_location or "cpu")

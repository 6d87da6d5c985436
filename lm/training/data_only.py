"""Reading checkpoints as data, never as code.

A checkpoint is a pickle, and a pickle may name any function to call while it is read. lm reads every checkpoint
with torch's weights-only unpickler, which builds tensors, containers and plain values, and nothing else unless a
class is allowed by name. Allowed here, and nowhere broader: what DeepSpeed's shards and torch.distributed.checkpoint
(DCP, FSDP2's format) hold beyond tensors. Anything else a checkpoint asks for is refused in one line naming it
(UserError, exit 2), before a command runs or writes anything (`require_data_only`).

DeepSpeed and DCP read their own files with `weights_only=False`; inside `reading_data_only()` torch forces them to
weights-only (TORCH_FORCE_WEIGHTS_ONLY_LOAD) with the same allowed names. DCP's `.metadata` is a plain pickle that
DCP reads with `pickle.load`: it is checked here first, by an unpickler that knows only DCP's metadata classes.
"""

import contextlib
import io
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from lm.util.errors import UserError

FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"

# DCP's metadata (torch.distributed.checkpoint.metadata and filesystem), as `pickle.dump` writes it.
DCP_METADATA = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


def _deepspeed_globals() -> list:
    """The classes DeepSpeed's ZeRO shards hold (its loss scaler, ZeRO stage, parameter fragments), where DeepSpeed
    is installed; none otherwise (a machine without it cannot read its shards anyway)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _dcp_globals() -> list:
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return [*(getattr(metadata, name) for name in sorted(DCP_METADATA[metadata.__name__])), _StorageInfo]


def allowed_globals() -> list:
    """Everything beyond torch's own weights-only set that lm lets a checkpoint name."""
    return _deepspeed_globals() + _dcp_globals()


@contextlib.contextmanager
def reading_data_only() -> Iterator[None]:
    """Within: every torch.load, the libraries' own included, is weights-only with lm's allowed names."""
    before = os.environ.get(FORCE_ENV)
    os.environ[FORCE_ENV] = "1"
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            yield
    finally:
        if before is None:
            os.environ.pop(FORCE_ENV, None)
        else:
            os.environ[FORCE_ENV] = before


def refusal(path: str | Path, err: Exception) -> UserError:
    """The one line for a checkpoint that asks for code: the global it names, where torch says it."""
    text = " ".join(str(err).split())
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"global '?([\w.]+)", text)
    what = f"asks for {found.group(1)}" if found else f"is not plain data ({text[:160]})"
    return UserError(f"checkpoint {path} {what}, which lm does not load: a checkpoint is read as data only "
                     "(tensors, numbers, strings, containers), never as code")


def load(path: str | Path, map_location: str | Callable = "cpu", mmap: bool = False):
    """torch.load, weights-only, with lm's allowed names; a checkpoint that asks for more is a UserError."""
    try:
        with reading_data_only():
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise refusal(path, err) from None


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in DCP_METADATA.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}'")


def _check_dcp(directory: Path) -> None:
    """DCP's metadata through the restricted unpickler, then every non-tensor item it records (torch.save'd bytes
    inside the .distcp files) weights-only."""
    for metadata_file in sorted(directory.glob("*.metadata")):
        try:
            with open(metadata_file, "rb") as f:
                metadata = _DCPMetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise refusal(metadata_file, err) from None
        except (EOFError, AttributeError, TypeError, ValueError) as err:
            raise UserError(f"checkpoint {metadata_file} is unreadable ({' '.join(str(err).split())[:160]})") \
                from None
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        for fqn, entry in getattr(metadata, "state_dict_metadata", {}).items():
            if not isinstance(entry, BytesStorageMetadata):
                continue
            where = (metadata.storage_data or {}).get(MetadataIndex(fqn))
            if where is None:
                continue
            with open(directory / where.relative_path, "rb") as f:
                f.seek(where.offset)
                item = io.BytesIO(f.read(where.length))
            try:
                with reading_data_only():
                    torch.load(item, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as err:
                raise refusal(directory / where.relative_path, err) from None


def require_data_only(path: str | Path) -> None:
    """Refuse (UserError) a checkpoint, a file or a directory of any strategy's shards, any of whose pickles names
    something beyond plain data and lm's allowed names. Tensors are mapped, not read, so this costs little."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        # torch.save's format: a plain checkpoint, a DeepSpeed shard, FSDP2's meta.pt (a .distcp file holds raw
        # tensors and torch.save'd items, which _check_dcp finds through the metadata)
        if file.suffix != ".distcp" and zipfile.is_zipfile(file):
            try:
                load(file, mmap=True)
            except RuntimeError as err:
                raise UserError(f"checkpoint {file} is unreadable ({' '.join(str(err).split())[:160]})") from None
    if path.is_dir():
        _check_dcp(path)

"""lm.training.checkpoint on single-file checkpoints that have no manifest (written before lm kept them): they are
trusted only if every byte is what torch's writer recorded, by the CRC-32 of each zip member."""

import zipfile
from pathlib import Path

import pytest
import torch

from lm.training.checkpoint import checkpoint_problem, manifest_of, newest_checkpoint, require_usable
from lm.util.errors import UserError


def plain_checkpoint(path: Path, seed: int = 0) -> Path:
    """A torch.save'd file with a few tensors and no manifest beside it."""
    g = torch.Generator().manual_seed(seed)
    torch.save({"state_dict": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
                "global_step": 7}, path)
    assert not manifest_of(path).exists()
    return path


def tensor_data_span(path: Path, suffix: str = "data/0") -> tuple[int, int]:
    """(offset, length) in the file of the stored bytes of the zip member ending in `suffix`: a tensor's data."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    assert info.compress_type == zipfile.ZIP_STORED  # torch stores tensor bytes as they are
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)  # the local file header: its name and extra field lengths are at bytes 26-29
    name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_whole_checkpoint_without_manifest_is_usable(tmp_path):
    path = plain_checkpoint(tmp_path / "step=00000001.ckpt")
    assert checkpoint_problem(path) is None
    assert require_usable(path) == path


def test_a_flipped_byte_inside_a_tensor_is_reported_in_one_line(tmp_path):
    """torch.load reads the damaged file without complaint (the tensor just holds another number); the check reads
    every member against its recorded CRC-32 and names the damaged one."""
    older = plain_checkpoint(tmp_path / "step=00000001.ckpt", seed=1)
    path = plain_checkpoint(tmp_path / "step=00000002.ckpt")
    original = torch.load(path)["state_dict"]["w"]
    offset, length = tensor_data_span(path)
    assert length == 64 * 64 * 4
    flip_byte(path, offset + length // 2)
    damaged = torch.load(path)["state_dict"]["w"]  # silently different: this is what the check is for
    assert not torch.equal(damaged, original) and (damaged != original).sum() == 1
    problem = checkpoint_problem(path)
    assert problem is not None and len(problem.splitlines()) == 1
    assert str(path) in problem and "damaged" in problem and "data/0" in problem, problem
    with pytest.raises(UserError, match="damaged"):
        require_usable(path)
    assert newest_checkpoint(tmp_path, warn=False) == older  # a resume falls back to the older, whole one


def test_a_truncated_checkpoint_without_manifest_is_reported(tmp_path):
    path = plain_checkpoint(tmp_path / "step=00000001.ckpt")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    problem = checkpoint_problem(path)
    assert problem is not None and len(problem.splitlines()) == 1 and str(path) in problem

"""Token shards on disk: writing a split's shards, and reading shards and manifest.json back verified (which
tokens go to which split: holdout.py).

A split is the concatenation of its shards, flat little-endian arrays of token ids: sep doc sep doc ...
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from lm.util.errors import UserError

FORMAT = "lm-shards/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int) -> str:
    """The smallest dtype name that holds every token id."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def remove_outputs(directory: Path) -> None:
    """Delete a previous run's manifest (first, so it never points at half-replaced shards) and shards."""
    (directory / MANIFEST).unlink(missing_ok=True)
    for split in SPLITS:
        for path in [*directory.glob(f"{split}_[0-9]*.bin"), *directory.glob(f".{split}_[0-9]*.bin.tmp")]:
            path.unlink()


class ShardWriter:
    """Streams one split's documents into shards of `shard_tokens` tokens, each renamed into place when full."""

    def __init__(self, directory: Path, split: str, dtype: str, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, DTYPES[dtype], shard_tokens
        self.shards, self.file = [], None
        self.tokens = self.documents = 0

    def _open(self) -> None:
        self.name = f"{self.split}_{len(self.shards):05d}.bin"
        self.tmp = self.directory / f".{self.name}.tmp"
        self.file = open(self.tmp, "wb", buffering=1 << 20)  # spans add() calls; closed in _finish
        self.hash, self.fill, self.shard_docs = hashlib.sha256(), 0, 0

    def _finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())  # data on disk before the name says the shard is complete
        self.file.close()
        os.replace(self.tmp, self.directory / self.name)
        self.shards.append({"name": self.name, "tokens": self.fill, "documents": self.shard_docs,
                            "sha256": self.hash.hexdigest()})
        self.file = None

    def add(self, ids: np.ndarray) -> None:
        """Append one document ([sep, *tokens]); it may continue into the next shard."""
        if self.file is None:
            self._open()
        self.shard_docs += 1  # counted where its separator lands
        self.documents += 1
        self.tokens += len(ids)
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self.file is None:
                self._open()
            take = min(len(ids), self.shard_tokens - self.fill)
            data = ids[:take].tobytes()
            self.file.write(data)
            self.hash.update(data)
            self.fill += take
            ids = ids[take:]
            if self.fill == self.shard_tokens:
                self._finish()

    def close(self) -> dict:
        """Finish the last shard; return the split's manifest entry."""
        if self.file is not None:
            self._finish()
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}


def _check_format(manifest, path: Path) -> None:
    """UserError unless the manifest has the fields the reader relies on."""
    def require(ok: bool, what: str) -> None:
        if not ok:
            raise UserError(f"bad manifest {path}: {what}")

    try:
        require(manifest["format"] == FORMAT, f"format is not {FORMAT}")
        require(manifest["dtype"] in DTYPES, f"unknown dtype {manifest['dtype']!r}")
        tok = manifest["tokenizer"]
        require(Path(tok["file"]).name == tok["file"] and isinstance(tok["sha256"], str), "bad tokenizer entry")
        for split in SPLITS:
            for shard in manifest["splits"][split]["shards"]:
                require(Path(shard["name"]).name == shard["name"], f"bad shard name {shard['name']!r}")
                require(isinstance(shard["tokens"], int) and isinstance(shard["sha256"], str), "bad shard entry")
    except (KeyError, TypeError, IndexError) as e:
        raise UserError(f"bad manifest {path}: missing or malformed {e}") from None


def _check_file(path: Path, sha256: str, size: int | None, verify: bool, what: str) -> None:
    """UserError if the file is missing, has the wrong size, or (verify) the wrong sha256."""
    if not path.is_file():
        raise UserError(f"missing {what} {path}")
    if size is not None and path.stat().st_size != size:
        raise UserError(f"corrupt {what} {path}: {path.stat().st_size} bytes, manifest says {size}")
    if verify and sha256_file(path) != sha256:
        raise UserError(f"corrupt {what} {path}: sha256 mismatch")


def load_manifest(directory: str | os.PathLike, verify: bool = True) -> dict:
    """Read manifest.json and check every file it names; verify=True also checks sha256 (reads everything)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise UserError(f"missing {path}: prepare the data first")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"bad manifest {path}: {e}") from None
    _check_format(manifest, path)
    tok = manifest["tokenizer"]
    _check_file(directory / tok["file"], tok["sha256"], None, verify, "tokenizer")
    itemsize = DTYPES[manifest["dtype"]].itemsize
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            _check_file(directory / shard["name"], shard["sha256"], shard["tokens"] * itemsize, verify, "shard")
    return manifest


def open_split(directory: str | os.PathLike, manifest: dict, split: str) -> list[np.memmap]:
    """Read-only memmaps of a split's shards, in order (their concatenation is the split's token stream)."""
    if split not in manifest["splits"]:
        raise UserError(f"unknown split {split!r} (have: {', '.join(manifest['splits'])})")
    dtype = DTYPES[manifest["dtype"]]
    return [np.memmap(Path(directory) / s["name"], dtype=dtype, mode="r") for s in manifest["splits"][split]["shards"]]

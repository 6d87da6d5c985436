"""One prepared directory: the fingerprint of what determines its bytes, reuse of an identical one, and writing it
(tokenizer.json first, then the shards, the manifest last). `lm prepare` writes one; a recipe writes one per source in
a single pass; a SLURM merge writes them from the array's parts."""

import hashlib
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lm.util.errors import UserError
from lm.util.output import write_json

from .holdout import BY_TOKENS, Holdout, SplitWriter
from .shards import FORMAT, MANIFEST, load_manifest, remove_outputs, sha256_file
from .sources import Source
from .tokenizer import save_tokenizer, separator, vocab_size_of

VERSION = 3  # bump when the same inputs and settings would produce different shards (2: validation from a tail;
# 3: validation by tokens, with a floor in windows)
HOLDOUT_KEYS = ("val_seq_len", "min_val_windows")  # settings since version 3: older versions' fingerprints lack them


def log(message: str) -> None:
    """One line for the user on stderr (stdout stays clean for scripts)."""
    print(message, file=sys.stderr, flush=True)


def source_identity(source: Source) -> list:
    """Each file's path, size and content hash, or the dataset spec (plus the hashes of local data_files)."""
    if not source.dataset:
        return [[str(p), p.stat().st_size, sha256_file(p)] for p in source.files]
    local = [Path(f) for f in source.data_files or () if Path(f).is_file()]  # edits to local data must count
    return [source.dataset, source.dataset_config, source.split, list(source.data_files or ()),
            [[str(p.resolve()), sha256_file(p)] for p in local]]


def files_and_sizes(source: Source) -> list:
    """Each file's path and size: what a SLURM task checks against its plan without reading the whole corpus."""
    return [[str(p), p.stat().st_size] for p in source.files]


def settings(source: Source, tok_key: str, holdout: Holdout, seed: int, shard_tokens: int,
             identity=source_identity) -> dict:
    """Everything besides the code's VERSION that determines the output bytes (source_identity hashes every input
    file once)."""
    return {"sources": identity(source), "tokenizer": tok_key, "val_fraction": holdout.fraction, "seed": seed,
            "shard_tokens": shard_tokens, "text_field": source.text_field, "val_seq_len": holdout.seq_len,
            "min_val_windows": holdout.min_windows}


def fingerprint(settings: dict, version: int = VERSION) -> str:
    """sha256 over everything that determines the output bytes, as `version` of lm prepare writes them."""
    return hashlib.sha256(json.dumps({**settings, "version": f"{FORMAT}/{version}"}, sort_keys=True).encode()
                          ).hexdigest()


@dataclass(frozen=True)
class Target:
    """A directory to prepare: the fingerprints of its settings (this version's first, then older versions'), and
    which documents go into it (a recipe's source: {"field", "value"} or {"source", "files"}; None: all)."""

    directory: Path
    fingerprints: tuple[str, ...]
    select: dict | None = None

    @property
    def fingerprint(self) -> str:
        return self.fingerprints[0]


def make_target(directory: Path, given: dict, select: dict | None = None) -> Target:
    """The target of these settings (plus the selection of a recipe's source, which a plain prepare has not)."""
    if select is not None:
        given = {**given, "select": select}
    older = {key: value for key, value in given.items() if key not in HOLDOUT_KEYS}
    return Target(Path(directory), tuple(fingerprint(given if v >= 3 else older, v) for v in range(VERSION, 0, -1)),
                  select)


def reusable(out: Path, fps: tuple[str, ...], overwrite: bool) -> dict | None:
    """The existing manifest when `out` already holds this exact, intact dataset (fps[0]); never clobber another
    one, but rebuild what an older lm prepare made of the same inputs (fps[1:])."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output path is not a directory: {out}")
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        old = None
    if isinstance(old, dict) and old.get("fingerprint") in fps[1:]:
        log(f"rebuilding {out}: an older lm prepare wrote it, and its train/validation split may differ")
        return None
    if not isinstance(old, dict) or old.get("fingerprint") != fps[0]:
        if overwrite:
            return None
        raise UserError(f"{out} already holds a different dataset (its {MANIFEST} has another fingerprint): "
                        "choose another --out or pass --overwrite true")
    try:
        return load_manifest(out, verify=True)
    except UserError as e:  # same dataset, damaged: rebuilding gives the same bytes back
        log(f"rebuilding {out}: {e}")
        return None


def begin(directory: Path, tok) -> dict:
    """Clear a previous dataset from `directory` and save the tokenizer there; its manifest entry."""
    directory.mkdir(parents=True, exist_ok=True)
    remove_outputs(directory)
    sha = save_tokenizer(tok, directory / "tokenizer.json")
    sep_token, sep_id = separator(tok)
    return {"file": "tokenizer.json", "sha256": sha, "vocab_size": vocab_size_of(tok), "sep_id": sep_id,
            "sep_token": sep_token}


class Output:
    """One target being written: documents in order, then finish() writes its manifest, last (its presence means
    everything else is complete)."""

    def __init__(self, target: Target, tokenizer: dict, dtype: str, shard_tokens: int, seed: int, holdout: Holdout,
                 sources: list[str]):
        self.target, self.tokenizer, self.dtype, self.sources = target, tokenizer, dtype, sources
        self.writer = SplitWriter(target.directory, dtype, shard_tokens, seed, holdout)
        self.replaced = 0

    def add(self, ids: np.ndarray, replaced: int) -> None:
        self.writer.add(ids)
        self.replaced += replaced

    def finish(self) -> dict:
        manifest = {
            "format": FORMAT,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "fingerprint": self.target.fingerprint,
            "sources": self.sources,
            "replaced_bytes": self.replaced,
            "splits": self.writer.close(),
        }
        if self.target.select is not None:
            manifest["select"] = self.target.select
        write_json(self.target.directory / MANIFEST, manifest)
        log(f"prepared {self.target.directory}: {summary(manifest)}")
        return manifest


def fill(stream: Iterable[tuple[np.ndarray, int, str | None]], outputs: dict[str | None, Output]) -> dict:
    """Each document (ids, replaced bytes, group) into its group's output, in order; then every output's manifest,
    by group."""
    for ids, replaced, group in stream:
        outputs[group].add(ids, replaced)
    return {group: output.finish() for group, output in outputs.items()}


def summary(manifest: dict) -> str:
    """Documents and tokens per split, how much validation holds (in windows, by holdout.py's rule), and replaced
    bytes, in one line."""
    splits = manifest["splits"]
    parts = [f"{s}: {e['documents']:,} documents, {e['tokens']:,} tokens" for s, e in splits.items()]
    if splits["validation"].get("held_out") == BY_TOKENS:
        parts[-1] += held_out(splits)
    return "; ".join(parts) + f"; {manifest['replaced_bytes']:,} replaced bytes"


def held_out(splits: dict) -> str:
    """What validation holds beyond its counts: its share of the tokens, its windows against the floor, a document
    cut in two."""
    val = splits["validation"]
    share = 100 * val["tokens"] / max(1, val["tokens"] + splits["train"]["tokens"])
    said = f" ({share:.2g}% of the tokens), {val['windows']:,} windows of --seq_len {val['seq_len']}"
    if val["windows"] < val["min_windows"]:
        said += (f", fewer than --min_val_windows {val['min_windows']} since the floor takes at most a quarter of the "
                 "corpus (add text, or lower --seq_len)")
    return said + (", one of its documents the tail of a training document" if val["cut"] else "")

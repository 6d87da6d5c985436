"""prepare(): documents -> tokenizer -> train/validation shards + manifest.json, reused when nothing changed."""

import hashlib
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lm.errors import UserError
from lm.output import write_json
from lm.resources import shipped

from .shards import (
    DTYPES,
    FORMAT,
    MANIFEST,
    TAIL,
    load_manifest,
    remove_outputs,
    sha256_file,
    token_dtype,
    write_splits,
)
from .sources import Document, Source, make_source
from .tokenizer import (
    check_vocab_size,
    load_tokenizer,
    save_tokenizer,
    separator,
    tokenizer_key,
    train_bpe,
    vocab_size_of,
)

BUNDLED_CORPUS = shipped("data_prep/corpus/kjv.jsonl.gz")
VERSION = 2  # bump when the same inputs and settings would produce different shards (2: validation from a tail)


def log(message: str) -> None:
    """One line for the user on stderr (stdout stays clean for scripts)."""
    print(message, file=sys.stderr, flush=True)


def check_settings(tokenizer: str | None, vocab_size: int, val_fraction: float, shard_tokens: int,
                   batch_docs: int) -> None:
    """Reject impossible settings before reading anything."""
    if tokenizer is None:
        check_vocab_size(vocab_size)
    if not 0 < val_fraction < 1:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if shard_tokens < 1 or batch_docs < 1:
        raise UserError(f"shard_tokens and batch_docs must be positive, got {shard_tokens} and {batch_docs}")


def source_identity(source: Source) -> list:
    """Each file's path, size and content hash, or the dataset spec (plus the hashes of local data_files)."""
    if not source.dataset:
        return [[str(p), p.stat().st_size, sha256_file(p)] for p in source.files]
    local = [Path(f) for f in source.data_files or () if Path(f).is_file()]  # edits to local data must count
    return [source.dataset, source.dataset_config, source.split, list(source.data_files or ()),
            [[str(p.resolve()), sha256_file(p)] for p in local]]


def settings(source: Source, tok_key: str, val_fraction: float, seed: int, shard_tokens: int) -> dict:
    """Everything besides the code's VERSION that determines the output bytes (hashes every input file once)."""
    return {"sources": source_identity(source), "tokenizer": tok_key, "val_fraction": val_fraction, "seed": seed,
            "shard_tokens": shard_tokens, "text_field": source.text_field}


def fingerprint(settings: dict, version: int = VERSION) -> str:
    """sha256 over everything that determines the output bytes, as `version` of lm prepare writes them."""
    return hashlib.sha256(json.dumps({**settings, "version": f"{FORMAT}/{version}"}, sort_keys=True).encode()
                          ).hexdigest()


def reusable(out: Path, fps: list[str], overwrite: bool) -> dict | None:
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


def batched(items: Iterable, n: int) -> Iterator[list]:
    """Lists of up to n items."""
    it = iter(items)
    while batch := list(islice(it, n)):
        yield batch


def encode(docs: Iterable[Document], tok, sep_id: int, dtype: str, batch_docs: int, stats: dict) -> Iterator:
    """[sep, *ids] per document as an array; batches go through the tokenizer's Rust thread pool."""
    for batch in batched(docs, batch_docs):
        stats["replaced"] += sum(n for _, n in batch)
        for enc in tok.encode_batch_fast([text for text, _ in batch], add_special_tokens=False):
            ids = np.empty(len(enc.ids) + 1, dtype=DTYPES[dtype])
            ids[0] = sep_id
            ids[1:] = enc.ids
            yield ids


def get_tokenizer(tokenizer: str | None, source: Source, vocab_size: int, progress: bool):
    """Load the named tokenizer, or train a BPE with one pass over the documents; also return that pass's count."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer), None
    seen = tqdm(source.documents(), desc="reading for BPE", unit="doc", disable=not progress)
    tok = train_bpe((text for text, _ in seen), vocab_size, progress)
    return tok, seen.n if progress else None  # a disabled bar does not count


def prepare(
    inputs: Sequence[str] = (),
    out: str = "data/prepared",
    *,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    streaming: bool = False,
    data_files: list[str] | None = None,
    text_field: str = "text",
    tokenizer: str | None = None,
    vocab_size: int = 8192,
    val_fraction: float = 0.01,
    seed: int = 0,
    shard_tokens: int = 2**27,
    batch_docs: int = 1000,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize a corpus into train/validation token shards with a manifest.json, reusing an identical result.

    Args:
        inputs: Files, directories (searched recursively) or glob patterns: .txt (a file is one document),
            .jsonl (one JSON object per line), .parquet, and gzipped .txt.gz/.jsonl.gz. With no inputs and no
            dataset, the bundled King James Bible corpus (1189 chapters) is used.
        out: Output directory for tokenizer.json, the .bin shards and manifest.json.
        dataset: A Hugging Face `datasets` name (or a builder such as "json" with data_files) instead of inputs.
        dataset_config: The dataset's configuration name, if it has several.
        split: The dataset split to read.
        streaming: Stream the dataset instead of downloading it whole first.
        data_files: Files passed to the dataset builder (for builders like "json", "parquet", "text").
        text_field: The JSON key, parquet column or dataset column holding the text.
        tokenizer: A tokenizer.json path or a Hugging Face hub name; default: train a byte-level BPE.
        vocab_size: Vocabulary size of the trained BPE (ignored with tokenizer).
        val_fraction: Fraction of whole documents held out for validation (at least one when there are two).
            When the seeded draw holds none out (one document, or a few), validation is instead this fraction of
            the tokens, taken from the tail of the last document if it is long enough.
        seed: Seed of the train/validation split.
        shard_tokens: Tokens per shard file.
        batch_docs: Documents per tokenizer batch (tokenized in parallel).
        overwrite: Replace a different dataset already in out.
        progress: Show progress bars.

    Returns:
        The manifest (as written to out/manifest.json).
    """
    check_settings(tokenizer, vocab_size, val_fraction, shard_tokens, batch_docs)
    if not inputs and not dataset:
        inputs = [str(BUNDLED_CORPUS)]
    source = make_source(inputs, dataset=dataset, dataset_config=dataset_config, split=split, streaming=streaming,
                         data_files=data_files, text_field=text_field)
    out = Path(out)
    given = settings(source, tokenizer_key(tokenizer, vocab_size), val_fraction, seed, shard_tokens)
    fps = [fingerprint(given, version) for version in range(VERSION, 0, -1)]  # this version's first
    if manifest := reusable(out, fps, overwrite):
        log(f"reusing {out}: {summary(manifest)}")
        return manifest
    if next(source.documents(), None) is None:  # fail before touching out
        raise UserError(f"empty corpus: no non-blank documents in {', '.join(source.describe())}")

    tok, n_docs = get_tokenizer(tokenizer, source, vocab_size, progress)
    sep_token, sep_id = separator(tok)
    vocab = vocab_size_of(tok)
    dtype = token_dtype(vocab)
    out.mkdir(parents=True, exist_ok=True)
    remove_outputs(out)
    tok_sha = save_tokenizer(tok, out / "tokenizer.json")
    tok.encode_special_tokens = True  # "<|endoftext|>" typed inside a document is text, not a separator

    stats = {"replaced": 0}
    docs = tqdm(source.documents(), desc="tokenizing", unit="doc", total=n_docs, disable=not progress)
    splits = write_splits(encode(docs, tok, sep_id, dtype, batch_docs, stats), out, dtype, shard_tokens,
                          seed, val_fraction)
    manifest = {
        "format": FORMAT,
        "tokenizer": {"file": "tokenizer.json", "sha256": tok_sha, "vocab_size": vocab, "sep_id": sep_id,
                      "sep_token": sep_token},
        "dtype": dtype,
        "fingerprint": fps[0],
        "sources": source.describe(),
        "replaced_bytes": stats["replaced"],
        "splits": splits,
    }
    write_json(out / MANIFEST, manifest)  # last: its presence means everything else is complete
    log(f"prepared {out}: {summary(manifest)}")
    return manifest


def summary(manifest: dict) -> str:
    """Documents and tokens per split, how validation was held out when not by whole documents, and replaced
    bytes, in one line."""
    parts = [f"{s}: {e['documents']:,} documents, {e['tokens']:,} tokens" for s, e in manifest["splits"].items()]
    if manifest["splits"]["validation"].get("held_out") == TAIL:
        parts[-1] = tail_summary(manifest["splits"])
    return "; ".join(parts) + f"; {manifest['replaced_bytes']:,} replaced bytes"


def tail_summary(splits: dict) -> str:
    """The validation part of the summary when it came from the tail of the last document."""
    val = splits["validation"]["tokens"]
    share = 100 * val / (val + splits["train"]["tokens"])
    return (f"validation: {val:,} tokens ({share:.2g}% of tokens) from {TAIL} "
            "(too few documents to hold a whole one out)")

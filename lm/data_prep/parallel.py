"""Documents -> token arrays ([sep, *ids] each, in the documents' order): in this process, batches through the
tokenizer's own Rust thread pool; or (`lm prepare --workers N`) in N worker processes.

Worker processes are spawned (a fork would inherit the parent's tokenizer threads), each loads the tokenizer from the
saved tokenizer.json and runs it on one thread (TOKENIZERS_PARALLELISM=false): N workers then use about N cores, and a
worker's thread pool would only contend with the others' (on 2 cores, 2 one-thread workers tokenized ~10% faster than
2 workers of 2 threads each). This process keeps reading the documents and writing the shards; at most 2 batches per
worker are in flight, so memory stays bounded however large the corpus, and the batches come back in order, so the
shards are the same bytes whatever N.
"""

import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import islice
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from .shards import DTYPES
from .sources import Record


def batched(items: Iterable, n: int) -> Iterator[list]:
    """Lists of up to n items."""
    it = iter(items)
    while batch := list(islice(it, n)):
        yield batch


def encode_texts(tok, texts: list[str], sep_id: int, dtype: str) -> list[np.ndarray]:
    """[sep, *ids] per text, as arrays of `dtype`."""
    arrays = []
    for enc in tok.encode_batch_fast(texts, add_special_tokens=False):
        ids = np.empty(len(enc.ids) + 1, dtype=DTYPES[dtype])
        ids[0] = sep_id
        ids[1:] = enc.ids
        arrays.append(ids)
    return arrays


_worker = {}  # a worker process's tokenizer and settings (its initializer sets them)


def _start_worker(tokenizer_file: str, sep_id: int, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker (read by tokenizers at each batch)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_file)
    tok.encode_special_tokens = True  # as prepare() sets it: "<|endoftext|>" inside a document is text
    _worker.update(tok=tok, sep_id=sep_id, dtype=dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """One batch, as one flat array and the documents' lengths (a few large objects to send back, not many)."""
    arrays = encode_texts(_worker["tok"], texts, _worker["sep_id"], _worker["dtype"])
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    return (np.concatenate(arrays) if arrays else np.empty(0, DTYPES[_worker["dtype"]])), lengths


def in_order(pool: ProcessPoolExecutor, fn, batches: Iterable[list[Record]], ahead: int) -> Iterator[tuple]:
    """(batch, fn(its texts)) for each batch, computed in the pool, given back in the batches' order with at most
    `ahead` in flight (Executor.map would read every batch first)."""
    pending: deque[tuple[list[Record], Future]] = deque()
    for batch in batches:
        pending.append((batch, pool.submit(fn, [text for text, _, _ in batch])))
        if len(pending) >= ahead:
            batch, future = pending.popleft()
            yield batch, future.result()
    while pending:
        batch, future = pending.popleft()
        yield batch, future.result()


def tokenized(records: Iterable[Record], tok, tokenizer_file: Path, sep_id: int, dtype: str, batch_docs: int,
              workers: int) -> Iterator[tuple[np.ndarray, int, str | None]]:
    """(ids, replaced bytes, group) per document, in order, ids = [sep, *tokens]: by `tok` in this process
    (workers=1), else by `tokenizer_file` loaded in each of `workers` processes."""
    batches = batched(records, batch_docs)
    if workers == 1:
        for batch in batches:
            arrays = encode_texts(tok, [text for text, _, _ in batch], sep_id, dtype)
            yield from ((ids, replaced, group) for ids, (_, replaced, group) in zip(arrays, batch))
        return
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_start_worker,
                             initargs=(str(tokenizer_file), sep_id, dtype)) as pool:
        for batch, (flat, lengths) in in_order(pool, _encode_in_worker, batches, 2 * workers):
            arrays = np.split(flat, np.cumsum(lengths[:-1]))
            yield from ((ids, replaced, group) for ids, (_, replaced, group) in zip(arrays, batch))

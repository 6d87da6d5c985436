"""The BPE's training text when it is a sample of the corpus (`--tokenizer_sample_docs`, `--tokenizer_sample_bytes`):
a large corpus is then read once to tokenize, not twice.

The sample spreads over the corpus without reading it all: the input files in an order shuffled by the seed, each read
from its start, until the budget is spent. Files it does not reach are never opened. A corpus that is shuffled across
its files (SlimPajama's chunks) gives a fair sample this way; a dataset gives its first documents. A recipe whose
sources name their own files shares the budget out by the sources' weights, so that every source is in the sample as
much as in training."""

import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

from lm.util.errors import UserError

from .sources import Document, Source


@dataclass(frozen=True)
class Sample:
    """A budget of documents and/or UTF-8 bytes of text (None: no limit of that kind), and the shuffle's seed."""

    docs: int | None = None
    bytes: int | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("docs", "bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"tokenizer_sample_{name} must be positive, got {value}")

    @property
    def active(self) -> bool:
        return self.docs is not None or self.bytes is not None

    def spent(self, docs: int, size: int) -> bool:
        return (self.docs is not None and docs >= self.docs) or (self.bytes is not None and size >= self.bytes)

    def key(self) -> str:
        """What identifies the sample in the tokenizer's part of the dataset fingerprint."""
        return f"sample:docs={self.docs},bytes={self.bytes},seed={self.seed}"


def sample_documents(source: Source, sample: Sample) -> Iterator[Document]:
    """The sample's documents: files in the seeded shuffled order, each from its start, until the budget."""
    files = list(source.files)
    random.Random(sample.seed).shuffle(files)
    docs = replace(source, files=tuple(files)).documents()
    taken = size = 0
    try:
        for text, replaced in docs:
            taken += 1
            size += len(text.encode("utf-8"))
            yield text, replaced
            if sample.spent(taken, size):
                return  # before reading on: a file past the budget is not even opened
    finally:
        docs.close()  # the file being read is closed now, not when the generator is collected


def shared_out(sample: Sample, weights: dict[str, float]) -> dict[str, Sample]:
    """Each group's part of the budget, in proportion to its weight (at least one document or byte)."""
    total = sum(weights.values())

    def part(budget: int | None, weight: float) -> int | None:
        return None if budget is None else max(1, round(budget * weight / total))

    return {group: Sample(part(sample.docs, w), part(sample.bytes, w), sample.seed) for group, w in weights.items()}


def sample_groups(source: Source, sample: Sample, weights: dict[str, float]) -> Iterator[Document]:
    """A sample of each group's files (source.file_groups) within its share of the budget, group after group."""
    groups = dict(source.file_groups)
    for group, part in shared_out(sample, weights).items():
        yield from sample_documents(replace(source, files=tuple(p for p in source.files if groups[p] == group)), part)

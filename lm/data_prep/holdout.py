"""Which tokens `lm prepare` holds out for validation: by tokens, not documents, with a floor in windows.

Validation is `fraction` of the corpus's tokens, and at least `min_windows` windows of `seq_len` + 1 tokens (windows
that overlap by one token, as `lm train` and `lm eval ppl` cut them), but that floor never takes more than a quarter
of the corpus: a small corpus keeps the whole windows a quarter of it holds (none, when a quarter is less than one).

Documents go one at a time, in order, and memory stays bounded however large the corpus:

- While the corpus streams, a document is held out whole when validation is behind its share of the tokens so far,
  by a seeded draw: with probability (its share behind) / (the document's length), surely once validation is a whole
  document behind. So validation stays within about a document of `fraction` of the tokens at every point, spread over
  the corpus, and the seed picks which documents. The first document always trains, so training is never empty.
- The last training documents are held back, as many as the floor could need (min_windows x seq_len + 1 tokens, and
  the document that crosses it). At the end, when validation is short of its target (the floor, or the fraction
  where the draw left it short, as for one long book; never less than a window, which no window could read), it
  takes them from the end of the corpus: whole documents,
  the last first, and of the first one that is longer than what is still missing, its tail. That document is cut in
  two: its head stays in training, its tail goes to validation after a separator of its own (every document of a
  split starts with one), so the split counts it as a document too. At most one document is cut.
"""

import hashlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .shards import SPLITS, ShardWriter

BY_TOKENS = "tokens"  # the manifest's splits.validation.held_out for this rule (older: whole documents, a tail)
FLOOR_SHARE = 4  # the floor takes at most 1 / FLOOR_SHARE of the corpus


@dataclass(frozen=True)
class Holdout:
    """What validation holds: `fraction` of the tokens and at least `min_windows` windows of seq_len + 1 tokens."""

    fraction: float = 0.01
    seq_len: int = 256
    min_windows: int = 64

    def windows(self, tokens: int) -> int:
        """Windows of seq_len + 1 tokens, overlapping by one, in `tokens` tokens (lm.training.data.count_windows)."""
        return max(0, (tokens - 1) // self.seq_len)

    def floor(self, corpus_tokens: int) -> int:
        """The floor's tokens: min_windows windows, or the whole windows a quarter of the corpus holds."""
        windows = min(self.min_windows, self.windows(corpus_tokens // FLOOR_SHARE))
        return windows * self.seq_len + 1 if windows else 0

    def target(self, corpus_tokens: int) -> int:
        """What the end tops validation up to: the fraction's tokens or the floor, whichever is more; nothing when
        that is less than one window (a piece no window could read)."""
        target = max(int(self.fraction * corpus_tokens), self.floor(corpus_tokens))
        return target if self.windows(target) else 0

    def most_taken_at_the_end(self) -> int:
        """The training tokens held back for the end: as many as the floor can take."""
        return self.min_windows * self.seq_len + 1


def draw(index: int, seed: int) -> float:
    """A seeded number in [0, 1) for document `index`, the same on every run and machine."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


class SplitWriter:
    """Routes each document ([sep, *tokens]) to train or validation by the rule of the module's docstring and writes
    their shards (a pass that fills several datasets at once pushes into one writer each)."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int, seed: int, holdout: Holdout):
        self.writers = {split: ShardWriter(directory, split, dtype, shard_tokens) for split in SPLITS}
        self.seed, self.holdout = seed, holdout
        self.index, self.tokens = -1, 0
        self.held_back: deque[np.ndarray] = deque()  # the last training documents, in order
        self.held_back_tokens = 0

    def add(self, ids: np.ndarray) -> None:
        """The next document, [sep, *tokens]."""
        self.index += 1
        self.tokens += len(ids)
        behind = self.holdout.fraction * self.tokens - self.writers["validation"].tokens
        if self.index > 0 and behind >= draw(self.index, self.seed) * len(ids):
            self.writers["validation"].add(ids)
            return
        self.held_back.append(ids)
        self.held_back_tokens += len(ids)
        while self.held_back_tokens - len(self.held_back[0]) >= self.holdout.most_taken_at_the_end():
            self.held_back_tokens -= len(first := self.held_back.popleft())
            self.writers["train"].add(first)

    def taken_from_the_end(self) -> tuple[list[np.ndarray], bool]:
        """The documents (and the tail of one) that bring validation to its target, in corpus order, taken off the
        held-back ones; and whether a document was cut."""
        train, validation = self.writers["train"], self.writers["validation"]
        missing, taken = self.holdout.target(self.tokens) - validation.tokens, []
        while missing > 0 and self.held_back:
            last = self.held_back[-1]
            cut = max(missing - 1, 1)  # content tokens of the tail; its separator is the one more
            if len(last) - cut >= 2:  # the head keeps its separator and a token
                self.held_back[-1] = last[:len(last) - cut]
                taken.append(np.concatenate([last[:1], last[-cut:]]))
                return taken[::-1], True
            if len(self.held_back) == 1 and train.documents == 0:
                break  # the one training document left stays
            taken.append(self.held_back.pop())
            missing -= len(last)
        return taken[::-1], False

    def close(self) -> dict:
        """Take validation's shortfall from the end, finish the shards; return {split: entry}."""
        taken, cut = self.taken_from_the_end()
        for ids in self.held_back:
            self.writers["train"].add(ids)
        for ids in taken:
            self.writers["validation"].add(ids)
        splits = {split: writer.close() for split, writer in self.writers.items()}
        h = self.holdout
        splits["validation"].update(held_out=BY_TOKENS, seq_len=h.seq_len, windows=h.windows(
            splits["validation"]["tokens"]), min_windows=h.min_windows, cut=cut)
        return splits


def write_splits(docs, directory: Path, dtype: str, shard_tokens: int, seed: int, holdout: Holdout) -> dict:
    """Write a stream of documents ([sep, *tokens] each) as train/validation shards (SplitWriter); {split: entry}."""
    writer = SplitWriter(directory, dtype, shard_tokens, seed, holdout)
    for ids in docs:
        writer.add(ids)
    return writer.close()

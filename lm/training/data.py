"""Token windows for training and validation, read from the shards that ``lm prepare`` writes.

The concatenated tokens of a split are cut into windows of seq_len + 1 tokens that overlap by one token (every
token after the first is a target exactly once). Training visits the windows of epoch e in the order of a
permutation seeded by (seed, e), epoch after epoch without end; the run's length is set by its steps. Position p
of that global stream is consumed by rank p mod world, and within a rank micro-batch t comes from worker
t mod num_workers: for micro_batch 1, rank r of world w, worker j of n, gets positions r + w * (j + n * i).
The only state is the number of windows consumed, so a resume is exact and survives a change of world size.
Under context parallelism (strategy.context_parallel N) "rank" and "world" here are the data-parallel rank and size
(global rank // N, world / N): the N ranks of a context group read the same windows, each training on its piece.

A mixture (data.sources) has one such stream per source, each with its own epochs and permutations (source i > 0
seeded by (seed, e, i)); lm.training.mixture says which source, and which of its positions, each global position
reads. `data.path` is a mixture of one, and reads exactly as above. Lightning's data module over these streams is
lm.training.data_module's.

The `data` section of a run config (DataConfig, DataSource) is lm.training.data_config's, which parses without torch;
they are found here too.
"""

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from lm.data_prep.shards import load_manifest, open_split
from lm.training.data_config import DataConfig, DataSource, source_name  # noqa: F401 - found here too
from lm.training.mixture import MixtureSchedule
from lm.util.errors import UserError


class TokenStream:
    """The tokens of one split as a single sequence, read from memory-mapped shards without copying them all."""

    def __init__(self, directory: str, split: str, verify: bool = True):
        self.directory, self.split = directory, split
        self.manifest = load_manifest(directory, verify=verify)
        if split not in self.manifest["splits"]:
            raise UserError(f"{directory}: no {split!r} split in manifest.json")
        self.shards = open_split(directory, self.manifest, split)
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.total = int(self.starts[-1])

    def __getstate__(self):
        # Pickling a memmap copies its data: send the location to worker processes and map it again there.
        return {"directory": self.directory, "split": self.split}

    def __setstate__(self, state):
        self.__init__(state["directory"], state["split"], verify=False)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, crossing shard boundaries where needed."""
        pieces, end = [], start + length
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for i in range(first, len(self.shards)):
            lo, hi = max(start, self.starts[i]), min(end, self.starts[i + 1])
            if lo >= hi:
                break
            pieces.append(self.shards[i][lo - self.starts[i]:hi - self.starts[i]])
        return np.concatenate(pieces).astype(np.int64)


def count_windows(total_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens that overlap by one token."""
    return max(0, (total_tokens - 1) // seq_len)


def epoch_permutation(n_windows: int, seed: int, epoch: int, source: int = 0) -> np.ndarray:
    """The order of a source's windows in one epoch (source 0 keeps the seeding of a single stream)."""
    return np.random.default_rng([seed, epoch] + ([source] if source else [])).permutation(n_windows)


class TrainWindows(IterableDataset):
    """Endless micro-batches [micro_batch, seq_len + 1] for one rank, starting after `start` consumed windows, drawn
    from the sources' streams as `schedule` interleaves them (one stream: no schedule needed)."""

    def __init__(self, streams: TokenStream | list[TokenStream], seq_len: int, micro_batch: int, seed: int,
                 start: int, rank: int = 0, world: int = 1, schedule: MixtureSchedule | None = None):
        self.streams = streams if isinstance(streams, list) else [streams]
        self.schedule = schedule or MixtureSchedule([1.0] * len(self.streams))
        if len(self.schedule.rates) != len(self.streams):
            raise ValueError("one weight per stream")
        self.seq_len, self.micro_batch, self.seed = seq_len, micro_batch, seed
        self.start, self.rank, self.world = start, rank, world
        self.n_windows = [count_windows(s.total, seq_len) for s in self.streams]
        self._epochs = {}  # source -> (epoch, its permutation): one per source in memory, as positions only grow

    def positions(self, t: int) -> list[int]:
        """Stream positions of this rank's micro-batch t."""
        return [self.start + self.rank + self.world * (t * self.micro_batch + u) for u in range(self.micro_batch)]

    def window(self, position: int) -> tuple[int, int]:
        """(source, window index in that source) at `position` of the global stream."""
        source, n = self.schedule.locate(position)
        epoch, i = divmod(n, self.n_windows[source])
        if self._epochs.get(source, (None,))[0] != epoch:
            self._epochs[source] = (epoch, epoch_permutation(self.n_windows[source], self.seed, epoch, source))
        return source, int(self._epochs[source][1][i])

    def __iter__(self):
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        t = worker
        while True:
            rows = []
            for p in self.positions(t):
                source, w = self.window(p)
                rows.append(self.streams[source].read(w * self.seq_len, self.seq_len + 1))
            yield torch.from_numpy(np.stack(rows))
            t += n_workers


class ValidationWindows(Dataset):
    """The first `limit` windows of a split, in order (deterministic, unshuffled)."""

    def __init__(self, stream: TokenStream, seq_len: int, limit: int | None = None):
        self.stream, self.seq_len = stream, seq_len
        n = count_windows(stream.total, seq_len)
        self.n = n if limit is None else min(n, limit)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.from_numpy(self.stream.read(i * self.seq_len, self.seq_len + 1))


def check_validation(stream: TokenStream, seq_len: int) -> None:
    """UserError unless the validation split holds a window: Lightning would otherwise train without validating,
    saying so only in a warning."""
    if stream.total == 0:
        raise UserError(f"the validation split of {stream.directory} is empty: prepare it again (lm prepare now "
                        "holds validation out of long documents) or set data.val_windows 0 to train without "
                        "validation")
    if count_windows(stream.total, seq_len) == 0:
        raise UserError(f"the validation split of {stream.directory} holds {stream.total} tokens, less than one "
                        f"window of seq_len + 1 = {seq_len + 1}: prepare it again with a larger --val_fraction or "
                        "set data.val_windows 0 to train without validation")


def check_one_tokenizer(sources: list[DataSource], manifests: list[dict]) -> None:
    """Every source must have been prepared with the first source's tokenizer (the same tokenizer.json bytes)."""
    first = manifests[0]["tokenizer"]["sha256"]
    for source, manifest in zip(sources[1:], manifests[1:], strict=True):
        if manifest["tokenizer"]["sha256"] != first:
            raise UserError(f"data.sources: {source.path} was prepared with another tokenizer than "
                            f"{sources[0].path} (tokenizer.json sha256 {manifest['tokenizer']['sha256'][:12]} vs "
                            f"{first[:12]}): prepare every source with one, e.g. lm prepare --tokenizer "
                            f"{sources[0].path}/tokenizer.json")

"""Token windows for training and validation, read from the shards that ``lm prepare`` writes.

The concatenated tokens of a split are cut into windows of seq_len + 1 tokens that overlap by one token (every
token after the first is a target exactly once). Training visits the windows of epoch e in the order of a
permutation seeded by (seed, e), epoch after epoch without end; the run's length is set by its steps. Position p
of that global stream is consumed by rank p mod world, and within a rank micro-batch t comes from worker
t mod num_workers: for micro_batch 1, rank r of world w, worker j of n, gets positions r + w * (j + n * i).
The only state is the number of windows consumed, so a resume is exact and survives a change of world size.
"""

from dataclasses import dataclass
from functools import lru_cache

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from lm.data_prep.shards import load_manifest, open_split
from lm.errors import UserError


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


@lru_cache(maxsize=2)
def epoch_permutation(n_windows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_windows)


def window_at(position: int, n_windows: int, seed: int) -> int:
    """Index of the window at `position` of the endless training stream."""
    epoch, i = divmod(position, n_windows)
    return int(epoch_permutation(n_windows, seed, epoch)[i])


class TrainWindows(IterableDataset):
    """Endless micro-batches [micro_batch, seq_len + 1] for one rank, starting after `start` consumed windows."""

    def __init__(self, stream: TokenStream, seq_len: int, micro_batch: int, seed: int, start: int,
                 rank: int = 0, world: int = 1):
        self.stream, self.seq_len, self.micro_batch, self.seed = stream, seq_len, micro_batch, seed
        self.start, self.rank, self.world = start, rank, world
        self.n_windows = count_windows(stream.total, seq_len)

    def positions(self, t: int) -> list[int]:
        """Stream positions of this rank's micro-batch t."""
        return [self.start + self.rank + self.world * (t * self.micro_batch + u) for u in range(self.micro_batch)]

    def __iter__(self):
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        t = worker
        while True:
            windows = [window_at(p, self.n_windows, self.seed) for p in self.positions(t)]
            yield torch.from_numpy(np.stack([self.stream.read(w * self.seq_len, self.seq_len + 1) for w in windows]))
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


@dataclass
class DataConfig:
    """Where the tokens come from and how they are cut.

    Args:
        path: Directory written by ``lm prepare`` (manifest.json, tokenizer.json, shards).
        seq_len: Tokens per training sequence.
        micro_batch: Sequences per device per forward pass.
        global_batch: Sequences per optimizer step over all devices (None: micro_batch x accumulate x world).
        global_batch_tokens: The same in tokens (a multiple of seq_len); give either.
        num_workers: Data-loader worker processes per device.
        seed: Seed of the window order.
        val_windows: Validation windows evaluated each time (None: all of them; 0: no validation at all).
        verify: Check every shard's sha256 against the manifest when loading.
        reset_at_documents: Start every document of a window from an empty state (every mixer's state, conv buffers
            and KV cache cleared at the separator, attention masked block-diagonally, RoPE positions from the
            document's start). Off by default, as in the MesaNet paper's recipe. The model keeps it (as
            ``model.document_separator``), so evaluation and generation reset alike.
    """

    path: str = "data/prepared"
    seq_len: int = 2048
    micro_batch: int = 8
    global_batch: int | None = None
    global_batch_tokens: int | None = None
    num_workers: int = 1
    seed: int = 0
    val_windows: int | None = 256
    verify: bool = True
    reset_at_documents: bool = False

    def __post_init__(self):
        if self.val_windows is not None and self.val_windows < 0:
            raise UserError(f"data.val_windows must be 0 (no validation), positive or null (all), got "
                            f"{self.val_windows}")


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


class TokenDataModule(L.LightningDataModule):
    """Training and validation loaders over prepared shards; its checkpointed state is the windows consumed."""

    def __init__(self, cfg: DataConfig):
        super().__init__()
        self.cfg = cfg
        self.windows_consumed = 0
        self.train_stream = TokenStream(cfg.path, "train", verify=cfg.verify)
        self.val_stream = TokenStream(cfg.path, "validation", verify=False)  # verified with the train split
        if count_windows(self.train_stream.total, cfg.seq_len) == 0:
            raise UserError(f"{cfg.path}: {self.train_stream.total} training tokens is less than one window of "
                            f"seq_len + 1 = {cfg.seq_len + 1}")
        if cfg.val_windows != 0:
            check_validation(self.val_stream, cfg.seq_len)

    @property
    def manifest(self) -> dict:
        return self.train_stream.manifest

    def train_dataloader(self):
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        dataset = TrainWindows(self.train_stream, self.cfg.seq_len, self.cfg.micro_batch, self.cfg.seed,
                               self.windows_consumed, rank, world)
        return DataLoader(dataset, batch_size=None, num_workers=self.cfg.num_workers,
                          persistent_workers=False)

    def val_dataloader(self):
        dataset = ValidationWindows(self.val_stream, self.cfg.seq_len, self.cfg.val_windows)
        return DataLoader(dataset, batch_size=self.cfg.micro_batch, shuffle=False, num_workers=0)

    def state_dict(self):
        return {"windows_consumed": self.windows_consumed}

    def load_state_dict(self, state):
        self.windows_consumed = int(state["windows_consumed"])


class CountConsumedWindows(L.Callback):
    """Advances the data module's position after every training batch of every rank, before a checkpoint
    of that step is written (Lightning runs checkpoint callbacks after the others)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.datamodule.windows_consumed += batch.shape[0] * trainer.world_size

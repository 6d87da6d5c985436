"""The data as Lightning takes it: the data module over the streams of lm.training.data, whose checkpointed state is
the windows consumed, and the callback that counts them. Apart from the streams so that evaluation reads the data
without importing Lightning."""

import lightning as L
from torch.utils.data import DataLoader, DistributedSampler

from lm.mixers.context_parallel import layout
from lm.training.data import (
    DataConfig,
    TokenStream,
    TrainWindows,
    ValidationWindows,
    check_one_tokenizer,
    check_validation,
    count_windows,
)
from lm.training.mixture import MixtureSchedule
from lm.util.errors import UserError


class TokenDataModule(L.LightningDataModule):
    """Training and validation loaders over prepared shards, one stream per source of the mixture; its checkpointed
    state is the windows consumed."""

    def __init__(self, cfg: DataConfig, context_parallel: int = 1):
        super().__init__()
        self.cfg = cfg
        self.windows_consumed = 0
        self.context_parallel = context_parallel  # ranks that share each window (strategy.context_parallel)
        self.sources = cfg.mixture()
        self.train_streams = [TokenStream(s.path, "train", verify=cfg.verify) for s in self.sources]
        check_one_tokenizer(self.sources, [stream.manifest for stream in self.train_streams])
        self.val_streams = [TokenStream(s.path, "validation", verify=False)  # verified with the train split
                            for s in self.sources]
        self.schedule = MixtureSchedule([s.weight for s in self.sources])
        for stream in self.train_streams:
            if count_windows(stream.total, cfg.seq_len) == 0:
                raise UserError(f"{stream.directory}: {stream.total} training tokens is less than one window of "
                                f"seq_len + 1 = {cfg.seq_len + 1}")
        if cfg.val_windows != 0:
            for stream in self.val_streams:
                check_validation(stream, cfg.seq_len)

    @property
    def manifest(self) -> dict:
        """The first source's manifest: its tokenizer is every source's."""
        return self.train_streams[0].manifest

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def tokens_per_source(self, windows: int) -> dict[str, int]:
        """Training tokens each source has given after `windows` windows of the stream."""
        counts = self.schedule.counts(windows) * self.cfg.seq_len
        return dict(zip(self.names, (int(c) for c in counts), strict=True))

    @property
    def replica(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size): the ranks of a context group (consecutive
        ranks, lm.mixers.context_parallel.layout) read the same windows."""
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        return layout(rank, world, self.context_parallel)[:2]

    def train_dataloader(self):
        rank, replicas = self.replica
        seed = 0 if self.cfg.seed is None else self.cfg.seed  # None outside a run (RunConfig sets the run's seed)
        dataset = TrainWindows(self.train_streams, self.cfg.seq_len, self.cfg.micro_batch, seed,
                               self.windows_consumed, rank, replicas, self.schedule)
        return DataLoader(dataset, batch_size=None, num_workers=self.cfg.num_workers,
                          persistent_workers=False)

    def val_dataloader(self):
        """One loader per source (a single one for a mixture of one). Lightning spreads the windows over the ranks;
        under context parallelism they are spread over the replicas here, each context group sharing its own."""
        rank, replicas = self.replica
        sampler = lambda windows: (DistributedSampler(windows, replicas, rank, shuffle=False)  # noqa: E731
                                   if self.context_parallel > 1 else None)
        loaders = []
        for stream in self.val_streams:
            windows = ValidationWindows(stream, self.cfg.seq_len, self.cfg.val_windows)
            loaders.append(DataLoader(windows, batch_size=self.cfg.micro_batch, shuffle=False, num_workers=0,
                                      sampler=sampler(windows)))
        return loaders[0] if len(loaders) == 1 else loaders

    def state_dict(self):
        return {"windows_consumed": self.windows_consumed}

    def load_state_dict(self, state):
        self.windows_consumed = int(state["windows_consumed"])



class CountConsumedWindows(L.Callback):
    """Advances the data module's position after every training batch of every rank, before a checkpoint
    of that step is written (Lightning runs checkpoint callbacks after the others)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.datamodule.windows_consumed += batch.shape[0] * trainer.datamodule.replica[1]

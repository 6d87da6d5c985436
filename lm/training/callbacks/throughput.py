"""Lightning's throughput monitor (train/ and validate/ samples_per_sec, items_per_sec, flops_per_sec, device/mfu,
with per-device figures under device/), with two changes: MFU against a configured peak, and a window that the N ranks
of a context group share (strategy.context_parallel) counted once.

Lightning computes every figure on global rank 0 and scales it by the world size. A rank of a context group holds a
1/N piece of each of its micro-batch's windows: its tokens (items) and its FLOPs (LMModule.flops_per_batch) are its
share, which the world size scales right. Its windows (samples) and micro-batches (batches) are the group's, shared
with N - 1 other ranks: Lightning requires whole samples (at least one per batch, which micro_batch < N would not give
as shares), so rank 0 counts its windows whole and their rates are divided by N here. Every global rate is then the
run's (windows and micro-batches counted once per group), and every device/ rate the global one over the world size.
The totals (train/samples, train/batches, train/lengths) stay rank 0's: the windows it took part in, its micro-batches
and its tokens.
"""

from lightning.fabric.utilities.throughput import Throughput as Rates
from lightning.pytorch.callbacks import ThroughputMonitor

SHARED = ("batches_per_sec", "samples_per_sec")  # counted per group on rank 0: divided by N


class SharedWindowRates(Rates):
    """Lightning's rates with the window and micro-batch rates of a context group of `pieces` ranks counted once."""

    def __init__(self, pieces: int, **kwargs):
        super().__init__(**kwargs)
        self.pieces = pieces

    def compute(self):
        metrics = super().compute()
        for key in SHARED:
            for name in (key, f"device{self.separator}{key}"):
                if name in metrics:
                    metrics[name] /= self.pieces
        return metrics


class Throughput(ThroughputMonitor):
    """Tokens/s, windows/s and FLOP/s; MFU against `peak_flops` (dense bf16 989e12 for an H100/H200) rather than
    Lightning's own table, so every architecture is measured against the same peak. `length_fn` gives this rank's
    tokens of a batch (its pieces under context parallelism); `pieces` is strategy.context_parallel."""

    def __init__(self, peak_flops: float | None, pieces: int, length_fn, window_size: int):
        super().__init__(batch_size_fn=len, length_fn=length_fn, window_size=window_size)  # windows, whole
        self.peak_flops, self.pieces = peak_flops, pieces

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        for key, rates in self._throughputs.items():
            self._throughputs[key] = SharedWindowRates(self.pieces, world_size=trainer.world_size,
                                                       available_flops=self.peak_flops or rates.available_flops,
                                                       **self.kwargs)

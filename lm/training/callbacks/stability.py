"""The stability monitor (after OLMo-core's): spike scores of the loss and the gradient norm, and what happens to a
step whose gradients are not finite.

- LMModule skips such a step: it drops the gradients before the optimizer sees them, so AdamW leaves the weights and
  its moments as they were (a loss that is not finite makes gradients that are not). The step still counts, and the
  schedule moves on. Under DeepSpeed, which clips inside its own step, nothing is skipped.
- This callback logs the skips (`train/skipped_steps`, the total) and each step's spike scores: how many standard
  deviations the loss and the gradient norm stand above their mean over the last `window` finite steps
  (`train/loss_spike`, `train/grad_norm_spike`).
- `stop_after` skips in a row stop the run: a checkpoint of that step, then `lm train` ends with one line naming it.
"""

import math
from collections import deque

import lightning as L


def spike_score(history: deque, value: float) -> float:
    """Standard deviations above the mean of history (0 until there are 10 values to measure against)."""
    if len(history) < 10:
        return 0.0
    mean = sum(history) / len(history)
    std = math.sqrt(sum((h - mean) ** 2 for h in history) / (len(history) - 1))
    return (value - mean) / std if std > 0 else 0.0


class StabilityMonitor(L.Callback):
    def __init__(self, stop_after: int, window: int = 100):
        self.stop_after = stop_after
        self.history = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}
        self.diverged_at: int | None = None
        self._seen_step = None

    def on_fit_start(self, trainer, pl_module):
        self._seen_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._seen_step:
            return  # mid-accumulation: not an optimizer step boundary
        self._seen_step = trainer.global_step
        pl_module.log("train/skipped_steps", float(pl_module.skipped_steps))
        for name in self.history:
            value = trainer.callback_metrics.get(f"train/{name}")
            if value is not None and math.isfinite(value := float(value)):
                pl_module.log(f"train/{name}_spike", spike_score(self.history[name], value))
                self.history[name].append(value)
        if pl_module.skips_in_a_row >= self.stop_after:
            self.diverged_at = trainer.global_step
            trainer.should_stop = True
            next(c for c in trainer.callbacks if hasattr(c, "save_now")).save_now(trainer)

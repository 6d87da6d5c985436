"""Progress of a training run, counted in optimizer steps: on a terminal a bar (StepProgressBar); otherwise (CI, a
SLURM .out file, `lm train > log`) a plain line at the launch's first optimizer step and then every `every` steps
(ProgressLines), written and flushed as it happens, since a live bar written to a file shows nothing until the run
ends. The first step's line says the run is moving long before log_every steps have passed (a slow model on a CPU
can take minutes for them).

    step 10/20 | loss 5.4123 | tokens/s 12,345 | elapsed 0:00:04 | eta 0:00:04
    step 10/20 | val loss 5.5012 | val ppl 245.00

Validation has a line of its own as it ends (on the bar, Lightning's `val/loss`), at the step it followed: the step
that metrics.csv (lm.training.metrics_log) and the checkpoints give it too.
"""

import math
import sys
import time
from collections.abc import Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar


def clock(seconds: float) -> str:
    """H:MM:SS (hours grow past 24 rather than wrap)."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLines(L.Callback):
    """One line on stdout at this launch's first optimizer step, every `every` optimizer steps and at the last, and one
    after each validation, from global rank 0. tokens/s is the whole run's (this rank's tokens times the world size)
    over the wall-clock time since the previous line, validation and checkpoints included (the first line's: since
    training started); the ETA extrapolates this launch's mean time per step."""

    def __init__(self, every: int, tokens_of: Callable[[torch.Tensor], int]):
        self.every, self.tokens_of = every, tokens_of

    def on_train_start(self, trainer, pl_module):
        self.start = self.window_start = time.perf_counter()
        self.first_step = self.last_step = trainer.global_step  # a resumed launch starts past 0
        self.window_tokens = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.window_tokens += self.tokens_of(batch)
        step = trainer.global_step  # optimizer steps: under accumulation it moves every few micro-batches
        due = step % self.every == 0 or step == trainer.max_steps or step == self.first_step + 1
        if step == self.last_step or not due:
            return
        now = time.perf_counter()
        if trainer.is_global_zero:
            loss = trainer.callback_metrics.get("train/loss")
            elapsed = now - self.start
            eta = elapsed / (step - self.first_step) * (trainer.max_steps - step)
            tokens_per_s = self.window_tokens * trainer.world_size / max(now - self.window_start, 1e-9)
            print(f"step {step}/{trainer.max_steps} | loss {'n/a' if loss is None else f'{float(loss):.4f}'} | "
                  f"tokens/s {tokens_per_s:,.0f} | elapsed {clock(elapsed)} | eta {clock(eta)}", flush=True)
        self.last_step, self.window_start, self.window_tokens = step, now, 0

    def on_validation_end(self, trainer, pl_module):
        """A line with the loss of the validation that just ended (a mixture's: its sources' mean, weighted as
        training draws them) and its perplexity, as val/ppl logs it."""
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.sanity_checking or trainer.state.fn != "fit" or not trainer.is_global_zero or loss is None:
            return
        print(f"step {trainer.global_step}/{trainer.max_steps} | val loss {float(loss):.4f} | "
              f"val ppl {math.exp(min(float(loss), 50.0)):.2f}", flush=True)


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar counts the micro-batches of an epoch, and its default (Rich) one is labelled "Epoch 0/-2" for a
    run that has max_steps and no epochs. This one counts optimizer steps up to max_steps."""

    def init_train_tqdm(self):
        bar = super().init_train_tqdm()  # described as "Training"
        bar.unit = "step"
        return bar

    def on_train_start(self, trainer, *_):
        # Here, not at the epoch's start: a launch that resumes mid-epoch has none.
        super().on_train_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps)
        bar.initial = bar.n = trainer.global_step  # tqdm's rate and ETA then count this launch's steps only
        bar.refresh()

    def on_train_epoch_start(self, trainer, *_):
        pass  # Lightning's would label the bar "Epoch N" and size it in micro-batches

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = self.train_progress_bar
        if bar.n != trainer.global_step:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # also redraws the bar

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version, not a metric
        return metrics


def progress_callbacks(enabled: bool, every: int, tokens_of: Callable[[torch.Tensor], int]) -> list[L.Callback]:
    """What trainer.progress_bar asks for: a bar when stdout is a terminal, plain lines when it is not (then the
    Trainer needs enable_progress_bar=False, or Lightning adds its own bar)."""
    if not enabled:
        return []
    return [StepProgressBar()] if sys.stdout.isatty() else [ProgressLines(every, tokens_of)]

"""Learning-rate schedules as plain functions of the optimizer step."""

import math
from dataclasses import dataclass
from typing import Literal

from lm.util.errors import UserError


@dataclass
class OptimConfig:
    """AdamW and its schedule (defaults: the MesaNet paper's recipe).

    Args:
        lr: Peak learning rate.
        betas: Adam betas.
        eps: Adam epsilon.
        weight_decay: Decay of the matrices (not of norms, biases, gates, embeddings).
        qk_weight_decay: Decay of the attention query/key matrices (None: weight_decay).
        vo_weight_decay: Decay of the attention value/output matrices (None: weight_decay).
        schedule: "cosine" (warmup, cosine to the floor) or "wsd" (warmup, stable, decay to the floor).
        warmup_steps: Steps of linear warmup from init_lr to lr.
        init_lr: Learning rate at step 0.
        min_lr_ratio: Floor as a fraction of lr.
        decay_fraction: For wsd, the last fraction of the steps spent decaying.
        grad_clip: Clip the global gradient norm to this (None: no clipping; the norm is logged either way).
    """

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.1
    qk_weight_decay: float | None = None
    vo_weight_decay: float | None = None
    schedule: Literal["cosine", "wsd"] = "cosine"
    warmup_steps: int = 2000
    init_lr: float = 1e-6
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    grad_clip: float | None = 1.0

    def __post_init__(self):
        """Impossible values end as one line at parse time; AdamW would only object at the first step, after the
        run directory is written."""
        decays = {name: getattr(self, name) for name in ("weight_decay", "qk_weight_decay", "vo_weight_decay")}
        checks = [(self.lr > 0, f"lr must be positive, got {self.lr}"),
                  (all(0 <= b < 1 for b in self.betas), f"betas must lie in [0, 1), got {list(self.betas)}"),
                  (self.eps > 0, f"eps must be positive, got {self.eps}"),
                  *((v is None or v >= 0, f"{name} must be at least 0, got {v}") for name, v in decays.items()),
                  (self.warmup_steps >= 0, f"warmup_steps must be at least 0, got {self.warmup_steps}"),
                  (self.init_lr >= 0, f"init_lr must be at least 0, got {self.init_lr}"),
                  (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}"),
                  (0 <= self.decay_fraction <= 1, f"decay_fraction must lie in [0, 1], got {self.decay_fraction}"),
                  (self.grad_clip is None or self.grad_clip > 0,
                   f"grad_clip must be positive (or null: no clipping), got {self.grad_clip}")]
        for ok, message in checks:
            if not ok:
                raise UserError(f"optim.{message}")


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate after `step` optimizer steps of a run of `total_steps`."""
    floor = cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.init_lr + (cfg.lr - cfg.init_lr) * step / cfg.warmup_steps
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = total_steps - int(cfg.decay_fraction * total_steps)
    if step < decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    return cfg.lr - (cfg.lr - floor) * progress

"""Runs grouped into architectures, and each architecture's best learning rate: runs of one architecture that differ
only in lr and seed form its lr grid; the best lr has the lowest final validation loss averaged over seeds."""

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from lm.compare.plan import count
from lm.compare.run_results import RunResults


@dataclass
class ArchGroup:
    name: str  # the arch, with what else sets its runs apart from the arch's other runs ("mesa (model.d_model=64)")
    arch: str
    runs: list[RunResults]

    def mean_val_loss(self, lr: float | None) -> float | None:
        losses = [r.val_loss for r in self.runs if r.lr == lr and r.val_loss is not None]
        return statistics.fmean(losses) if losses else None

    @property
    def lrs(self) -> list[float | None]:
        return sorted({r.lr for r in self.runs}, key=lambda lr: (lr is None, lr or 0.0))

    @property
    def best_lr(self) -> float | None:
        """The lr of the lowest mean validation loss; None when no run logged a finite one (a diverged run logs
        nan: its lr is never the best)."""
        scored = [(loss, lr) for lr in self.lrs if (loss := self.mean_val_loss(lr)) is not None and math.isfinite(loss)]
        return min(scored, key=lambda pair: pair[0])[1] if scored else None

    @property
    def best_run(self) -> RunResults:
        """The run shown for the architecture: its lowest seed at the best lr (the first run if none is best)."""
        best = self.best_lr
        candidates = [r for r in self.runs if r.lr == best and r.val_loss is not None] or self.runs
        return min(candidates, key=lambda r: (r.seed is None, r.seed or 0, r.path))

    def seeds_at(self, lr: float | None) -> int:
        return sum(r.lr == lr for r in self.runs)


# Settings that follow from a run's size or its length: runs that differ in them are named by their parameters and
# tokens (a ladder's rungs), not by each setting.
SHAPE = ("model.d_model", "model.n_layers", "model.n_heads", "model.head_dim", "model.mlp_ratio")
LENGTH = ("trainer.max_steps", "optim.warmup_steps")


def group_name(arch: str, run: RunResults, differing: list[str]) -> str:
    """The arch, then what sets the run apart from the arch's other runs: its size and tokens where its shape or
    length differs, and any other setting by name."""
    parts = [f"{count(run.params)} params"] if set(differing) & set(SHAPE) else []
    parts += [f"{count(run.tokens)} tokens"] if set(differing) & set(LENGTH) else []
    parts += [f"{k}={run.setting[k]}" for k in differing if k not in SHAPE + LENGTH]
    return f"{arch} ({', '.join(parts)})" if parts else arch


def group_runs(runs: list[RunResults]) -> list[ArchGroup]:
    """One group per architecture; within one, runs whose settings differ beyond lr and seed are split apart and
    named by what differs (size and tokens, or the setting). The attention group comes first: it is the reference."""
    by_arch = defaultdict(list)
    for run in runs:
        by_arch[run.arch].append(run)
    groups = []
    for arch, members in by_arch.items():
        # A key that only some configs have comes from another version of lm, not from what was trained.
        keys = sorted(set.intersection(*(set(run.setting) for run in members)))
        differing = [k for k in keys if len({repr(run.setting[k]) for run in members}) > 1]
        split = defaultdict(list)
        for run in members:
            split[group_name(arch, run, differing)].append(run)
        groups += [ArchGroup(name, arch, sorted(group, key=lambda r: r.path)) for name, group in split.items()]
    return sorted(groups, key=lambda g: (g.arch != "attention", g.name))

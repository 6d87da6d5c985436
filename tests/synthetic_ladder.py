"""A ladder with no training: `synthetic(laws)` stands in for lm.compare.ladder.train_run and writes each run's result
drawn from a known law, as `lm train` leaves it (config.yaml, logs/version_0/metrics.csv with val/loss and
train/flops, its last checkpoint's file, its run record), so that `lm compare ladder` plans, sweeps, widens, picks,
fits and reports on numbers whose truth is known.

A law gives an architecture's final loss at compute C (the training FLOPs the ladder plans for the run), its best lr
at a size, and its noise: loss = curve(C) x exp(CURVATURE x log(lr / best lr)^2) x exp(sigma x a normal draw fixed by
the run's name)."""

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from lm.accounting.flops import param_count, train_flops_per_token
from lm.compare.run_results import STEPS_DONE_MARK
from lm.model import LMConfig
from lm.training.run_record import launch_entry, record_launch

CURVATURE = 0.02  # the loss's rise per (log lr - log best lr)^2, relative: 2% at 2.7x off the best lr


@dataclass
class Law:
    curve: Callable[[float], float]  # final loss at compute C with the best lr
    best_lr: Callable[[int], float] = lambda params: 1e-2  # noqa: E731
    sigma: float = 0.0  # the seeds' noise, relative
    offsets: dict = field(default_factory=dict)  # rung label -> a relative shift of its runs (a law that misses it)


def noise(name: str) -> float:
    """A standard normal draw fixed by a run's name (so a rerun draws the same)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return float(np.random.default_rng(seed).standard_normal())


def truth(law: Law, compute: float, params: int, lr: float, rung: str, name: str) -> float:
    off = math.log(lr / law.best_lr(params)) ** 2
    return (law.curve(compute) * math.exp(CURVATURE * off) * (1 + law.offsets.get(rung, 0.0))
            * math.exp(law.sigma * noise(name)))


def synthetic(laws: dict[str, Law]):
    """A train_run that writes the run's result from laws[arch] (arch: the ladder's name for it, from the header
    of the config it wrote) and the compute the ladder planned for it."""

    def train_run(config: str) -> dict:
        path = Path(config)
        header = path.read_text().splitlines()[0]
        arch, rest = header.removeprefix("# ").split(" at rung ", 1)
        rung = rest.split(":")[0]
        raw = yaml.safe_load(path.read_text())
        model = LMConfig(**raw["model"])
        seq_len, batch, steps = raw["data"]["seq_len"], raw["data"]["global_batch"], raw["trainer"]["max_steps"]
        compute = train_flops_per_token(model, seq_len) * steps * batch * seq_len
        loss = truth(laws[arch], compute, param_count(model), raw["optim"]["lr"], rung, path.stem)
        run = Path(raw["run_dir"])
        (run / "logs" / "version_0").mkdir(parents=True, exist_ok=True)
        (run / "checkpoints").mkdir(exist_ok=True)
        (run / "config.yaml").write_text(yaml.safe_dump(raw))
        (run / "logs" / "version_0" / "hparams.yaml").write_text(STEPS_DONE_MARK + "\n")
        (run / "logs" / "version_0" / "metrics.csv").write_text(
            f"step,train/loss,val/loss,train/flops\n{steps},{loss},{loss},{compute}\n")
        (run / "checkpoints" / f"step={steps:08d}.ckpt").write_bytes(b"")
        record_launch(run, launch_entry("cpu", [raw["data"]["path"]], None, 1))  # what lm train records
        return {"seconds": 0.0}

    return train_run

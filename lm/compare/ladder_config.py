"""The ladder file of `lm compare ladder`: one YAML that says which architectures, which sizes, how many tokens, which
learning rates, seeds and probes, and what to predict. Every key is checked when the file is read, before anything
runs; configs/ladder/ has examples.

    archs: [attention, gated_deltanet, mesa]   # as lm compare plan --archs takes them
    rungs: [1.0e5, 2.0e5, 4.0e5]               # target parameters (tied embedding included), matched by lm compare plan
    base: cpu_base.yaml                        # an lm train config (relative to this file): data, optim, trainer
    match: params                              # or flops (training FLOPs per token)
    tokens_per_param: 20                       # the budget of each rung ...
    budgets: null                              # ... or total FLOPs per run: every rung at every budget (iso-FLOP)
    lr: {grid: [2.0e-3, 4.0e-3, 8.0e-3], sweep_rungs: 2, against: width, slope: null}
    seeds: [0, 1]
    probes: [[ppl], [longctx, --probes, "[passkey]"]]   # lm eval commands run on each finished run's checkpoint
    target_compute: 1.0e21                     # where the fits predict (FLOPs)
    level: 0.9                                 # of the bootstrap intervals
    bootstrap: 1000                            # replicates
    prepare: {vocab_size: 512}                 # optional: the bundled corpus, prepared into OUT/data, as the data
    gpu: {peak_flops: 9.89e14, mfu: {attention: 0.358}, default_mfu: 0.136, gpu_gib: 141}   # optional: GPU-hours
"""

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from lm.errors import UserError
from lm.resources import shipped


@dataclass(frozen=True)
class LrSweep:
    """The lr grid, swept on the `sweep_rungs` smallest rungs at the first seed; the larger rungs take the rule
    fitted to the swept rungs' best lrs (lm/compare/lr_transfer.py) against `against` (width: d_model; params),
    with `slope` fixed if given."""

    grid: tuple[float, ...]
    sweep_rungs: int = 2
    against: str = "width"
    slope: float | None = None


@dataclass(frozen=True)
class GpuEstimate:
    """What the planned GPU-hours assume: the dense bf16 peak and the MFU measured per mixer (a hybrid takes its
    slowest mixer's); the memory plan sets the micro-batch on one GPU of `gpu_gib`."""

    peak_flops: float = 989e12
    mfu: dict = field(default_factory=dict)
    default_mfu: float | None = None
    gpu_gib: float = 80.0


@dataclass(frozen=True)
class LadderSpec:
    path: Path
    archs: tuple[str, ...]
    rungs: tuple[float, ...]
    base: str
    lr: LrSweep
    match: str = "params"
    tokens_per_param: float = 20.0
    budgets: tuple[float, ...] | None = None
    seeds: tuple[int, ...] = (0,)
    probes: tuple[tuple[str, ...], ...] = ()
    target_compute: float | None = None
    level: float = 0.9
    bootstrap: int = 1000
    prepare: dict | None = None
    gpu: GpuEstimate | None = None


def number(value, key: str, path: Path) -> float:
    try:
        x = float(value)  # YAML reads 1e5 (no dot) as a string
    except (TypeError, ValueError):
        raise UserError(f"{path}: {key} must be a number, not {value!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise UserError(f"{path}: {key} must be positive, got {value!r}")
    return x


def numbers(value, key: str, path: Path) -> tuple[float, ...]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{path}: {key} must be a non-empty list of numbers")
    return tuple(number(v, key, path) for v in value)


def only_keys(mapping, allowed: list[str], where: str, path: Path) -> dict:
    if not isinstance(mapping, dict):
        raise UserError(f"{path}: {where} must be a mapping")
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        raise UserError(f"{path}: unknown key(s) {', '.join(unknown)} in {where} (known: {', '.join(allowed)})")
    return mapping


def lr_sweep(raw, path: Path, rungs: int) -> LrSweep:
    raw = only_keys(raw, [f.name for f in fields(LrSweep)], "lr", path)
    if "grid" not in raw:
        raise UserError(f"{path}: lr needs a grid (the learning rates swept on the smallest rungs)")
    sweep = LrSweep(grid=tuple(sorted(numbers(raw["grid"], "lr.grid", path))),
                    sweep_rungs=raw.get("sweep_rungs", 2), against=raw.get("against", "width"),
                    slope=None if raw.get("slope") is None else float(raw["slope"]))
    if sweep.against not in ("width", "params"):
        raise UserError(f"{path}: lr.against must be width or params, not {sweep.against!r}")
    if not isinstance(sweep.sweep_rungs, int) or not 1 <= sweep.sweep_rungs <= rungs:
        raise UserError(f"{path}: lr.sweep_rungs must be a whole number from 1 to the {rungs} rungs")
    if sweep.slope is None and sweep.sweep_rungs < 2 and sweep.sweep_rungs < rungs:
        raise UserError(f"{path}: one swept rung cannot fit the lr rule's slope: sweep 2 rungs or set lr.slope")
    return sweep


def gpu_estimate(raw, path: Path) -> GpuEstimate:
    raw = only_keys(raw, [f.name for f in fields(GpuEstimate)], "gpu", path)
    mfu = {name: number(v, f"gpu.mfu.{name}", path) for name, v in (raw.get("mfu") or {}).items()}
    default = raw.get("default_mfu")
    return GpuEstimate(peak_flops=number(raw.get("peak_flops", 989e12), "gpu.peak_flops", path), mfu=mfu,
                       default_mfu=None if default is None else number(default, "gpu.default_mfu", path),
                       gpu_gib=number(raw.get("gpu_gib", 80), "gpu.gpu_gib", path))


def load_ladder(path: str) -> LadderSpec:
    """The ladder file, checked: one clear line for a missing file, an unknown key or a bad value."""
    from lm.compare.plan import parse_archs

    file = Path(path)
    if not file.is_file() and not file.is_absolute() and shipped(path).is_file():
        file = shipped(path)  # configs/ladder/cpu.yaml, from a wheel as from a checkout
    if not file.is_file():
        raise UserError(f"ladder file {path} not found")
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"ladder file {path} is not valid YAML ({' '.join(str(err).split())})") from None
    allowed = [f.name for f in fields(LadderSpec) if f.name != "path"]
    only_keys(raw, allowed, "the ladder file", file)
    missing = [key for key in ("archs", "rungs", "base", "lr") if key not in raw]
    if missing:
        raise UserError(f"{file}: missing {', '.join(missing)}")
    archs = tuple(a.label for a in parse_archs(raw["archs"]))
    rungs = tuple(sorted(numbers(raw["rungs"], "rungs", file)))
    if len(set(rungs)) < len(rungs):
        raise UserError(f"{file}: a rung is named twice")
    base = Path(raw["base"]) if Path(raw["base"]).is_absolute() else file.parent / raw["base"]
    if not base.is_file():
        raise UserError(f"{file}: base config {base} not found")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds) \
            or len(set(seeds)) < len(seeds):
        raise UserError(f"{file}: seeds must be a list of distinct whole numbers")
    probes = raw.get("probes") or []
    if not isinstance(probes, list) or not all(isinstance(p, list) and p and all(isinstance(a, str) for a in p)
                                               for p in probes):
        raise UserError(f"{file}: probes must be a list of lm eval commands, each a list of strings "
                        f"([ppl, --max_windows, '64'])")
    spec = LadderSpec(
        path=file, archs=archs, rungs=rungs, base=str(base), lr=lr_sweep(raw["lr"], file, len(rungs)),
        match=raw.get("match", "params"),
        tokens_per_param=number(raw.get("tokens_per_param", 20), "tokens_per_param", file),
        budgets=None if raw.get("budgets") is None else tuple(sorted(numbers(raw["budgets"], "budgets", file))),
        seeds=tuple(seeds), probes=tuple(tuple(p) for p in probes),
        target_compute=None if raw.get("target_compute") is None else number(raw["target_compute"],
                                                                             "target_compute", file),
        level=number(raw.get("level", 0.9), "level", file), bootstrap=raw.get("bootstrap", 1000),
        prepare=only_keys(raw["prepare"], ["vocab_size"], "prepare", file) if raw.get("prepare") else None,
        gpu=gpu_estimate(raw["gpu"], file) if raw.get("gpu") else None)
    if spec.match not in ("params", "flops"):
        raise UserError(f"{file}: match must be params or flops, not {spec.match!r}")
    if not spec.level < 1:
        raise UserError(f"{file}: level must be between 0 and 1, got {spec.level}")
    if not isinstance(spec.bootstrap, int) or spec.bootstrap < 10:
        raise UserError(f"{file}: bootstrap must be a whole number of at least 10 replicates")
    if spec.budgets and len(spec.rungs) < 3:
        raise UserError(f"{file}: an iso-FLOP ladder (budgets) needs at least 3 rungs per budget for its parabolas")
    return spec

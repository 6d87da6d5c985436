"""The ladder file of `lm compare ladder`: one YAML that says which architectures, which sizes, how many tokens, which
learning rates, seeds and probes, and what to predict. Every key is checked when the file is read, before anything
runs; configs/ladder/ has examples.

    archs: [attention, gated_deltanet+attention, mesa]   # as lm compare plan --archs takes them
    rungs: [1.0e5, 2.0e5, 4.0e5]               # target parameters (tied embedding included), matched by lm compare plan
    base: cpu_base.yaml                        # an lm train config (relative to this file): data, optim, trainer
    match: params                              # or flops (training FLOPs per token)
    tokens_per_param: 20                       # the budget of each rung ...
    budgets: null                              # ... or total FLOPs per run: every rung at every budget (iso-FLOP)
    lr: {start: 4.0e-3, factors: [0.5, 1, 2], against: width, slope: null, widen: 3}   # a sweep at every rung
    sweep_seed: 0                              # the seed the lr sweep trains at (not one of seeds)
    seeds: [1, 2, 3]                           # fresh runs at each rung's chosen lr
    data_seed: null                            # null: each run orders the data by its own seed; N: one order for all
    allow_mixed_code: false                    # true: runs whose records name different lm code may share a report
    probes: [[ppl], [longctx, --probes, "[passkey]"]]   # lm eval commands run on each finished run's checkpoint
    target_compute: 1.0e21                     # where the fitted curves are read, labelled as extrapolated
    level: 0.9                                 # of the intervals
    bootstrap: 1000                            # replicates
    repeat_data: false                         # true: a run may read its corpus more than once (epochs said)
    prepare: {vocab_size: 512}                 # optional: the bundled corpus, prepared into OUT/data, as the data
    choose: {arch: mesa, option: cg_steps, values: [2, 4, 8, 30], reference: 30, rung: 3.1e5, lr: 1.0e-2,
             tolerance: 0.02}                  # optional: "mesa@cg_steps=chosen" in archs takes the measured choice
    gpu: {peak_flops: 9.89e14, mfu: {attention: 0.358}, default_mfu: 0.136, gpu_gib: 141}   # optional: GPU-hours
"""

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from lm.util.errors import UserError
from lm.util.resources import shipped

CHOSEN = "chosen"  # ARCH@OPTION=chosen: the value the ladder's `choose:` stage measures


@dataclass(frozen=True)
class LrSweep:
    """How each rung gets its lr (docs/ladder.md, "Learning rates").

    With `start` and `factors` (the default form): the smallest rung sweeps start x factors (start: one lr, or one per
    architecture); each larger rung sweeps the best lr of the rung below, times (its size / that rung's size)^slope
    (slope 0 unless `slope` is set), times the factors. A best lr at an end of a sweep widens it: the next lr beyond
    that end, by the factors' step there, up to `widen` more lrs a side. With `grid`: these lrs at each swept rung, as
    written (never widened). Only the `sweep_rungs` smallest rungs are swept (default: every rung); any larger rung
    takes the rule lr = c x size^s fitted over every swept rung's best lr (s fixed if `slope` is set); size: d_model
    (width) or the parameter count (params)."""

    start: float | dict | None = None  # a dict: each architecture as archs writes it -> lr
    factors: tuple[float, ...] = (0.5, 1.0, 2.0)
    grid: tuple[float, ...] | None = None
    sweep_rungs: int | None = None  # None: every rung
    against: str = "width"
    slope: float | None = None
    widen: int = 3

    def swept(self, rungs: int) -> int:
        """How many of the smallest rungs are swept."""
        return rungs if self.sweep_rungs is None else self.sweep_rungs

    def start_of(self, name: str) -> float:
        """The smallest rung's centre for an architecture as archs writes it."""
        return self.start[name] if isinstance(self.start, dict) else self.start


@dataclass(frozen=True)
class Choose:
    """An option chosen by measurement before the ladder runs (archs name it as ARCH@OPTION=chosen): `arch` trained at
    `rung` (matched params, tokens_per_param tokens) with each of `values` of `option`, at lr `lr` and every seed of
    `seeds`. The choice is the smallest value whose loss is shown to be at most `tolerance` (nats) above the
    reference's: the upper end of the Welch interval (at the ladder's level) of its mean minus the reference's mean,
    both sides' seed noise in it, lies below the tolerance. The report says whether the choice was made at the
    largest rung that uses it."""

    arch: str
    option: str
    values: tuple
    reference: object
    rung: float
    lr: float
    seeds: tuple[int, ...]
    tolerance: float

    def candidate(self, value) -> str:
        return f"{self.arch}@{self.option}={written(value)}"

    @property
    def candidates(self) -> list[str]:
        return [self.candidate(v) for v in self.values]


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
    seeds: tuple[int, ...] = (1,)
    sweep_seed: int = 0
    data_seed: int | None = None
    allow_mixed_code: bool = False
    probes: tuple[tuple[str, ...], ...] = ()
    target_compute: float | None = None
    level: float = 0.9
    bootstrap: int = 1000
    prepare: dict | None = None
    gpu: GpuEstimate | None = None
    repeat_data: bool = False
    choose: Choose | None = None


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


def lr_sweep(raw, path: Path, rungs: int, labels: dict[str, str]) -> LrSweep:
    """The lr section; `labels`: each architecture as archs writes it -> its label (lr.start may name either)."""
    raw = only_keys(raw, [f.name for f in fields(LrSweep)], "lr", path)
    if ("grid" in raw) == ("start" in raw):
        raise UserError(f"{path}: lr needs either start (the smallest rung's centre, swept x factors at every rung) "
                        f"or grid (the same lrs at each swept rung)")
    if "grid" in raw and "factors" in raw:
        raise UserError(f"{path}: lr.factors goes with lr.start, not with lr.grid")
    start = raw.get("start")
    if isinstance(start, dict):  # keyed by each architecture as archs writes it (or by its label)
        by_label = {label: name for name, label in labels.items()}
        by_name = {by_label.get(key, key): number(lr, f"lr.start.{key}", path) for key, lr in start.items()}
        missing = [name for name in labels if name not in by_name]
        unknown = sorted(set(by_name) - set(labels))
        if missing or unknown:
            raise UserError(f"{path}: lr.start must give one lr for each architecture of archs: "
                            + "; ".join(part for part in (f"{', '.join(unknown)} not in archs" if unknown else "",
                                                          f"none for {', '.join(missing)}" if missing else "") if part))
        start = by_name
    elif start is not None:
        start = number(start, "lr.start", path)
    factors = tuple(sorted(set(numbers(raw.get("factors", [0.5, 1.0, 2.0]), "lr.factors", path))))
    sweep = LrSweep(start=start, factors=factors,
                    grid=tuple(sorted(numbers(raw["grid"], "lr.grid", path))) if "grid" in raw else None,
                    sweep_rungs=raw.get("sweep_rungs"), against=raw.get("against", "width"),
                    slope=None if raw.get("slope") is None else float(raw["slope"]), widen=raw.get("widen", 3))
    if sweep.start is not None and len(factors) < 3:
        raise UserError(f"{path}: lr.factors needs at least 3 (such as [0.5, 1, 2]), so that a best lr can lie between "
                        f"two others")
    if not isinstance(sweep.widen, int) or sweep.widen < 0:
        raise UserError(f"{path}: lr.widen must be a whole number of lrs a side, 0 or more")
    if sweep.against not in ("width", "params"):
        raise UserError(f"{path}: lr.against must be width or params, not {sweep.against!r}")
    if sweep.sweep_rungs is not None and (not isinstance(sweep.sweep_rungs, int)
                                          or not 1 <= sweep.sweep_rungs <= rungs):
        raise UserError(f"{path}: lr.sweep_rungs must be a whole number from 1 to the {rungs} rungs")
    if sweep.slope is None and sweep.swept(rungs) < 2 and sweep.swept(rungs) < rungs:
        raise UserError(f"{path}: one swept rung cannot fit the lr rule's slope: sweep 2 rungs or set lr.slope")
    return sweep


def choose_section(raw, path: Path, seeds: tuple[int, ...]) -> Choose:
    from lm.compare.plan import parse_archs

    raw = only_keys(raw, [f.name for f in fields(Choose)], "choose", path)
    missing = [key for key in ("arch", "option", "values", "reference", "rung", "lr", "tolerance") if key not in raw]
    if missing:
        raise UserError(f"{path}: choose needs {', '.join(missing)}")
    values = raw["values"]
    if not isinstance(values, list) or len(values) < 2 or not all(isinstance(v, (int, float)) for v in values) \
            or len(set(values)) < len(values):
        raise UserError(f"{path}: choose.values must be a list of at least 2 distinct numbers")
    if raw["reference"] not in values:
        raise UserError(f"{path}: choose.reference {raw['reference']!r} is not one of choose.values")
    picked = raw.get("seeds", list(seeds))
    if not isinstance(picked, list) or len(picked) < 2 or not all(isinstance(s, int) for s in picked) \
            or len(set(picked)) < len(picked):
        raise UserError(f"{path}: choose.seeds must list at least 2 distinct whole numbers (the reference's spread "
                        f"over seeds is the criterion)")
    choose = Choose(arch=str(raw["arch"]), option=str(raw["option"]), values=tuple(sorted(values)),
                    reference=raw["reference"], rung=number(raw["rung"], "choose.rung", path),
                    lr=number(raw["lr"], "choose.lr", path), seeds=tuple(picked),
                    tolerance=number(raw["tolerance"], "choose.tolerance", path))
    try:
        parse_archs(choose.candidates)
    except UserError as err:
        raise UserError(f"{path}: choose: {err}") from None
    return choose


def written(value) -> str:
    """An option's value as an architecture's name writes it (4, 0.001)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def resolved(name: str, choose: Choose | None, value) -> str:
    """An architecture's name with ARCH@OPTION=chosen replaced by `value` (before the choice: the reference)."""
    if choose is None:
        return name
    return name.replace(f"@{choose.option}={CHOSEN}", f"@{choose.option}={written(value)}")


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
    if not isinstance(raw["archs"], list) or not raw["archs"] or not all(isinstance(a, str) for a in raw["archs"]):
        raise UserError(f"{file}: archs must be a list of architectures (mixers, a+b patterns, hybrids, variants)")
    names = tuple(name.strip() for name in raw["archs"])
    seeds = raw.get("seeds", [1])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds) \
            or len(set(seeds)) < len(seeds):
        raise UserError(f"{file}: seeds must be a list of distinct whole numbers")
    sweep_seed, data_seed = raw.get("sweep_seed", 0), raw.get("data_seed")
    if not isinstance(sweep_seed, int) or (data_seed is not None and not isinstance(data_seed, int)):
        raise UserError(f"{file}: sweep_seed and data_seed must be whole numbers (data_seed: or null)")
    if sweep_seed in seeds:
        raise UserError(f"{file}: seeds include the sweep's seed {sweep_seed}: the sweep's best run is chosen on its "
                        f"own noise, so it is no fresh seed; list other seeds (or set sweep_seed)")
    for key in ("repeat_data", "allow_mixed_code"):
        if not isinstance(raw.get(key, False), bool):
            raise UserError(f"{file}: {key} must be true or false")
    choose = choose_section(raw["choose"], file, tuple(seeds)) if raw.get("choose") else None
    placeholders = [name for name in names if f"={CHOSEN}" in name]
    for name in placeholders:
        if choose is None or f"@{choose.option}={CHOSEN}" not in name:
            raise UserError(f"{file}: {name} takes a value chosen by measurement: add a choose section for "
                            f"{name.split('@')[0]}'s {name.split('=' + CHOSEN)[0].split('@')[-1]}")
    if choose is not None and not placeholders:
        raise UserError(f"{file}: choose measures {choose.arch}'s {choose.option}, but no architecture takes it "
                        f"(name one {choose.arch}@{choose.option}={CHOSEN} in archs)")
    # Each name as written (plan.parse_archs takes "a+b" patterns, hybrids and variants); a chosen value is checked
    # at the reference, which it may turn out to be.
    labels = {name: a.label for name, a in zip(names, parse_archs(
        [resolved(n, choose, choose.reference if choose else None) for n in names]))}
    rungs = tuple(sorted(numbers(raw["rungs"], "rungs", file)))
    if len(set(rungs)) < len(rungs):
        raise UserError(f"{file}: a rung is named twice")
    base = Path(raw["base"]) if Path(raw["base"]).is_absolute() else file.parent / raw["base"]
    if not base.is_file():
        raise UserError(f"{file}: base config {base} not found")
    probes = raw.get("probes") or []
    if not isinstance(probes, list) or not all(isinstance(p, list) and p and all(isinstance(a, str) for a in p)
                                               for p in probes):
        raise UserError(f"{file}: probes must be a list of lm eval commands, each a list of strings "
                        f"([ppl, --max_windows, '64'])")
    spec = LadderSpec(
        path=file, archs=names, rungs=rungs, base=str(base), lr=lr_sweep(raw["lr"], file, len(rungs), labels),
        match=raw.get("match", "params"),
        tokens_per_param=number(raw.get("tokens_per_param", 20), "tokens_per_param", file),
        budgets=None if raw.get("budgets") is None else tuple(sorted(numbers(raw["budgets"], "budgets", file))),
        seeds=tuple(seeds), sweep_seed=sweep_seed, data_seed=data_seed,
        allow_mixed_code=raw.get("allow_mixed_code", False), probes=tuple(tuple(p) for p in probes),
        target_compute=None if raw.get("target_compute") is None else number(raw["target_compute"],
                                                                             "target_compute", file),
        level=number(raw.get("level", 0.9), "level", file), bootstrap=raw.get("bootstrap", 1000),
        prepare=only_keys(raw["prepare"], ["vocab_size"], "prepare", file) if raw.get("prepare") else None,
        gpu=gpu_estimate(raw["gpu"], file) if raw.get("gpu") else None,
        repeat_data=raw.get("repeat_data", False), choose=choose)
    if spec.match not in ("params", "flops"):
        raise UserError(f"{file}: match must be params or flops, not {spec.match!r}")
    if not spec.level < 1:
        raise UserError(f"{file}: level must be between 0 and 1, got {spec.level}")
    if not isinstance(spec.bootstrap, int) or spec.bootstrap < 10:
        raise UserError(f"{file}: bootstrap must be a whole number of at least 10 replicates")
    if spec.budgets and len(spec.rungs) == 2:
        raise UserError(f"{file}: an iso-FLOP ladder (budgets) needs at least 3 rungs per budget for its parabolas "
                        f"(or one: every architecture at one size and matched compute)")
    return spec

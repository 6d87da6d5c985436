"""`lm compare plan`: the shape of each architecture at matched parameters or matched training FLOPs, the tokens a
budget buys, and ready-to-run `lm train` configs (a learning-rate grid and seeds per architecture) with a sweep file.

    lm compare plan --archs attention,mamba2,mesa,mesa+attention --match params --budget 2.6e18 \
        --base configs/attention/145m.yaml --out runs/compare/145m

Architectures: mixer names, hybrid layer patterns joined by "+" ("mesa+attention", repeated over the depth in
whole patterns), or a hybrid's name from lm/compare/paper_sizes.py (mesa_attention); any of them followed by
"@option=value" (repeatable) is a variant with that option on each of its mixers that has it ("mesa@cg_tol=1e-3"),
matched and named on its own.

Target size: `--params N` counts every parameter, the tied embedding included, as the MesaNet paper names its sizes
(its "145M" is configs/attention/145m.yaml, 146.0M) and as lm/compare/paper_sizes.py matches them; the table also shows
the count without the embedding. Given only `--budget C` (total training FLOPs), N follows Chinchilla's ~20 tokens
per parameter: C = 6 N D with D = 20 N, so N = sqrt(C / 120).

Reference shape: attention at N. Of SHAPE_LADDER's rungs (d_model, n_layers, head_dim: the paper's three sizes, and
smaller ones with head_dim 16-64 for CPU demos), the one whose attention model with the paper's SwiGLU 3 d_model is
nearest N; its depth refitted (even, half to twice the rung's); its MLP width fitted to N (where the embedding's
jumps between narrow rungs leave N out of reach: the nearest other rung and depth that reach it). Every architecture
starts from that shape, with n_heads = d_model / head_dim (Gated DeltaNet alone keeps its paper's half as many heads,
as lm/compare/paper_sizes.py does), and is matched:

- match=params: total parameters within 2% of N.
- match=flops: training FLOPs per token at seq_len (train_flops_per_token) within 2% of the reference's.

Moves: the reference shape with the MLP width alone refitted (as match_params_by_mlp does) while mlp_ratio
stays within 2x of the reference's; else the shape nearest the reference (least sum of |log ratio| of depth, width
and mlp_ratio; mlp_ratio within MLP_RATIO_RANGE) over depths in whole layer patterns up to twice the reference's;
over widths too (d_model in steps of head_dim up to twice, heads following) only when no depth fits. The table's
`move` column says which. At matched FLOPs Mesa moves most: its 30 CG steps per token cost more than attention's
quadratic term at these lengths, so it gets a thinner MLP or fewer layers.

Tokens: with a budget, each architecture trains budget / (its train FLOPs per token) tokens. At matched parameters
the total FLOPs are equal and the tokens differ; at matched FLOPs the tokens are equal too (within 2%). Without a budget
every architecture trains 20 tokens per target parameter, and the table shows what that costs each in FLOPs.
Steps = tokens / (global batch x seq_len), rounded.

Learning rates: the paper tuned the peak lr per model, so each architecture gets its own grid. The default brackets
the base config's optim.lr by factors of 2 (x0.5, x1, x2): that finds each mixer's optimum when it lies within 2x of
the base, and shows on which side it lies when not. A seed is the whole stochastic setting: the initialisation and
the data order (data.seed follows the run's seed), unless the base config fixes data.seed, when every run reads the
corpus in that one order.

Outputs under --out: plan.md (the table), plan.json (the same, exact, with each model config), configs/
ARCH-lrLR-seedS.yaml (the base config's data/optim/trainer/strategy sections, the matched model, lr, seed,
trainer.max_steps, run_dir OUT/runs/ARCH-lrLR-seedS; a short run's warmup cut to a tenth of its steps, its
validation and checkpoint intervals to its steps) and sweep.yaml in `lm slurm submit --array` format, submitted
with `--submit true` (`--dry_run true` prints the table only).
"""

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Literal

import yaml

from lm.accounting.flops import flops_notes, param_count, train_flops_per_token
from lm.mixers import MIXERS
from lm.mixers.context_parallel import check_layout
from lm.mixers.protocol import at_length
from lm.model import LMConfig
from lm.util.config_errors import load_yaml
from lm.util.errors import UserError
from lm.util.output import write_json

TOLERANCE = 0.02
TOKENS_PER_PARAM = 20  # Chinchilla
LR_MULTIPLES = (0.5, 1.0, 2.0)
MLP_RATIO_RANGE = (1.0, 6.0)  # SwiGLU hidden / d_model a matched model may have
MLP_MULTIPLES = (64, 32, 16, 8)  # hidden widths tried, the most hardware-friendly first
GOOD_ENOUGH = 0.005  # a coarser MLP multiple is kept when it comes this close
WARMUP_FRACTION = 0.1
PAPER_GLOBAL_BATCH = 256  # the MesaNet paper's sequences per step: a plan without --base trains at it
# (d_model, n_layers, head_dim), n_heads = d_model / head_dim: the paper's sizes (768, 1024, 1536), wider ones at
# its depth, and narrow ones with small heads, dense enough that the embedding's jumps leave few gaps.
SHAPE_LADDER = (
    (32, 2, 16), (48, 2, 16), (64, 2, 16), (80, 2, 16), (96, 2, 16), (112, 2, 16), (128, 2, 32), (128, 4, 32),
    (160, 4, 32), (192, 4, 32), (224, 4, 32), (256, 4, 32), (256, 6, 32), (320, 6, 32), (384, 6, 64), (448, 8, 64),
    (512, 8, 64), (640, 10, 64),
    (768, 14, 128), (1024, 28, 128), (1536, 28, 128), (2048, 28, 128), (2560, 32, 128), (3072, 32, 128),
    (4096, 32, 128), (5120, 40, 128), (6144, 48, 128), (8192, 64, 128),
)


@dataclass(frozen=True)
class Arch:
    label: str  # names files and runs: a mixer's name, or a hybrid's (mixers joined by "_"), with its options
    mixers: tuple[str, ...]  # the layer pattern, repeated over the depth (which holds whole patterns)
    options: tuple[tuple[str, object], ...] = ()  # a variant's own mixer options ("mesa@cg_tol=1e-3")

    @property
    def layer_pattern(self) -> str | None:
        return ",".join(self.mixers) if len(self.mixers) > 1 else None

    def configured(self, cfg: LMConfig) -> LMConfig:
        """cfg with this variant's options set on each of its mixers that has them."""
        if not self.options:
            return cfg
        given = {m: dict(o) for m, o in cfg.mixer_options.items()}
        for mixer in self.mixers:
            names = {f.name for f in fields(MIXERS[mixer].Options)}
            given.setdefault(mixer, {}).update({k: v for k, v in self.options if k in names})
        return replace(cfg, mixer_options=given)


def option_value(text: str):
    """An option's value as written after `=`: a number, true/false, null, or a word."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text.lower(), text)


def parse_variant(name: str, mixers: tuple[str, ...], written: list[str]) -> tuple[tuple[str, object], ...]:
    """The options of "ARCH@option=value@...", each an option of one of the arch's mixers."""
    options = []
    for item in written:
        key, sep, text = item.partition("=")
        known = [m for m in mixers if key in {f.name for f in fields(MIXERS[m].Options)}]
        if not sep or not known:
            raise UserError(f"architecture {name!r}: {item!r} is not OPTION=VALUE for an option of "
                            f"{' or '.join(sorted(set(mixers)))}")
        options.append((key, option_value(text)))
    return tuple(options)


def named_hybrids(paper_only: bool = False) -> dict[str, str]:
    """lm/compare/paper_sizes.py's hybrids (name -> layer pattern); with `paper_only`, the MesaNet paper's alone
    (PAPER_HYBRIDS)."""
    from lm.compare.paper_sizes import HYBRIDS, PAPER_HYBRIDS

    return {name: HYBRIDS[name] for name in PAPER_HYBRIDS} if paper_only else HYBRIDS


def parse_archs(archs: str | list[str]) -> list[Arch]:
    """Comma-separated (or listed) mixer names, "+"-joined patterns and named hybrids, each maybe a variant
    ("mesa@cg_tol=1e-3")."""
    names = archs.split(",") if isinstance(archs, str) else list(archs)
    hybrids = named_hybrids()
    parsed = []
    for name in (n.strip() for n in names):
        base, *variant = name.split("@")
        pattern = hybrids.get(base, base).replace(",", "+")
        mixers = tuple(m.strip() for m in pattern.split("+"))
        if not base or not all(m in MIXERS for m in mixers):
            raise UserError(f"unknown architecture {name!r}: give mixers ({', '.join(MIXERS)}), patterns such as "
                            f"mesa+attention, hybrids ({', '.join(hybrids) or 'none'}), or a variant such as "
                            f"mesa@cg_tol=1e-3")
        options = parse_variant(name, mixers, variant)
        parsed.append(Arch("@".join(["_".join(mixers), *variant]), mixers, options))
    labels = [a.label for a in parsed]
    if len(set(labels)) < len(labels):
        raise UserError(f"an architecture is named twice in --archs: {', '.join(labels)}")
    return parsed


def attention_at(template: LMConfig, d_model: int, n_layers: int, head_dim: int, mlp_ratio: float = 3.0) -> LMConfig:
    return replace(template, d_model=d_model, n_layers=n_layers, head_dim=head_dim, n_heads=d_model // head_dim,
                   mixer="attention", layer_pattern=None, mlp_ratio=mlp_ratio)


def fit_mlp(cfg: LMConfig, metric, target: float, ratios: tuple[float, float] = MLP_RATIO_RANGE) -> LMConfig | None:
    """cfg with the SwiGLU width (a multiple of 64, else 32, 16, 8; mlp_ratio within `ratios`) that brings metric
    nearest target; None when that is still more than TOLERANCE away. Both metrics are linear in the width."""
    d = cfg.d_model
    at_zero = metric(replace(cfg, mlp_ratio=0.0))
    per_unit = (metric(replace(cfg, mlp_ratio=1.0)) - at_zero) / d
    ideal = (target - at_zero) / per_unit
    best, best_error = None, math.inf
    for multiple in MLP_MULTIPLES:
        for hidden in {math.floor(ideal / multiple) * multiple, math.ceil(ideal / multiple) * multiple}:
            if not ratios[0] * d <= hidden <= ratios[1] * d:
                continue
            candidate = replace(cfg, mlp_ratio=hidden / d)
            error = abs(metric(candidate) / target - 1)
            if error < best_error:
                best, best_error = candidate, error
        if best_error <= GOOD_ENOUGH:
            break
    return best if best_error <= TOLERANCE else None


def default_archs() -> list[str]:
    """Every registered mixer, then the named hybrids (lm/compare/paper_sizes.py)."""
    return [*MIXERS, *named_hybrids()]


def heads_for(arch: Arch, d_model: int, head_dim: int) -> int:
    """d_model / head_dim heads, times the mixer's `paper_heads` for a single-mixer arch (Gated DeltaNet's and GLA's
    half); a hybrid's layers share the attention model's heads."""
    heads = d_model // head_dim
    if len(set(arch.mixers)) == 1:
        return max(1, int(heads * MIXERS[arch.mixers[0]].paper_heads))
    return heads


def match_shape(arch: Arch, reference: LMConfig, metric, target: float) -> tuple[LMConfig, str]:
    """arch's config whose metric is within TOLERANCE of target, and the move that got there: the reference shape
    with the MLP alone refitted (as sizing does) while mlp_ratio stays within 2x of the reference's, where the
    reference's depth is a whole number of arch's layer patterns; else the shape nearest the reference (least sum of
    |log ratio| of depth, width and mlp_ratio) over the depths in whole patterns (up to twice the reference's, at
    least one pattern), each with its MLP fitted; over widths (steps of head_dim, up to twice) only when no depth
    fits. A hybrid is never cut: "3:1" over a 2-layer reference is 4 layers, not 2 without attention."""
    d0, depth0, head_dim, ratio0 = reference.d_model, reference.n_layers, reference.head_dim, reference.mlp_ratio
    length = len(arch.mixers)
    depths = range(length, max(2 * depth0, length) + 1, length)

    def shaped(d_model: int, n_layers: int) -> LMConfig:
        return replace(reference, mixer=arch.mixers[0], layer_pattern=arch.layer_pattern, d_model=d_model,
                       n_layers=n_layers, n_heads=heads_for(arch, d_model, head_dim))

    def distance(cfg: LMConfig) -> float:
        return sum(abs(math.log(a / b)) for a, b in ((cfg.n_layers, depth0), (cfg.d_model, d0),
                                                     (cfg.mlp_ratio, ratio0)))

    if depth0 % length == 0 and (fitted := fit_mlp(shaped(d0, depth0), metric, target, (ratio0 / 2, 2 * ratio0))):
        return fitted, "mlp"
    for move, widths in (("depth", [d0]), ("width", range(head_dim, 2 * d0 + 1, head_dim))):
        fits = [cfg for cfg in (fit_mlp(shaped(d, n), metric, target) for d in widths for n in depths) if cfg]
        if fits:
            return min(fits, key=distance), move
    raise UserError(f"cannot match {arch.label} within {TOLERANCE:.0%} of {target:.4g} by MLP, depth or width "
                    f"around the reference (d_model {d0}, {depth0} layers); try another size")


def reference_shape(template: LMConfig, target: float, asked: str) -> LMConfig:
    """Attention at `target` parameters: the rung nearest at the paper's MLP, its depth refitted, its MLP fitted;
    failing that (a target between two rungs of a small model, where the embedding jumps), the nearest rung and
    depth whose MLP can fit."""
    off = lambda cfg: abs(math.log(param_count(cfg) / target))  # noqa: E731
    shapes = {rung: [attention_at(template, rung[0], n, rung[2]) for n in range(2, 2 * rung[1] + 1, 2)
                     if n >= rung[1] // 2] for rung in SHAPE_LADDER}
    nearest = min(SHAPE_LADDER, key=lambda rung: off(attention_at(template, *rung)))
    for cfg in [min(shapes[nearest], key=off), *sorted((c for cs in shapes.values() for c in cs), key=off)]:
        if fitted := fit_mlp(cfg, param_count, target):
            return fitted
    smallest = attention_at(template, *SHAPE_LADDER[0], mlp_ratio=MLP_RATIO_RANGE[0])
    if target < param_count(smallest):
        raise UserError(f"{asked} is too small: the smallest shape (d_model {smallest.d_model}, {smallest.n_layers} "
                        f"layers) has {param_count(smallest):,} parameters at vocab {template.vocab_size}")
    raise UserError(f"{asked}: no shape of the ladder (d_model {SHAPE_LADDER[0][0]}-{SHAPE_LADDER[-1][0]}) comes "
                    f"within {TOLERANCE:.0%} at vocab {template.vocab_size}, whose embedding grows in jumps with "
                    f"d_model; take another size or vocabulary")


def model_template(run, archs: list[Arch], seq_len: int, vocab_size: int | None) -> LMConfig:
    """The base config's model at seq_len (and vocab_size if given); options that scale with the length (SWA's
    window) follow seq_len where the base sets none."""
    given = run.model.mixer_options
    at_seq_len = {m: at_length(m, given.get(m, {}), seq_len) for arch in archs for m in arch.mixers
                  if MIXERS[m].length_options(seq_len)}
    return replace(run.model, vocab_size=vocab_size or run.model.vocab_size, max_seq_len=seq_len,
                   mixer_options={**given, **at_seq_len})


def matched_shapes(archs: list[Arch], reference: LMConfig, metric, goal: float) -> list[tuple[Arch, LMConfig, str]]:
    """(arch, its config, the move that matched it) for each arch: attention is the reference itself. Each config
    keeps the options of its own mixers alone (lm train refuses options for a mixer the model does not use)."""
    shapes = [(arch, *((arch.configured(reference), "reference") if arch.mixers == ("attention",) else
                       match_shape(arch, arch.configured(reference), metric, goal))) for arch in archs]
    return [(arch, replace(cfg, mixer_options=cfg.own_mixer_options()), move) for arch, cfg, move in shapes]


def load_base(base: str | None) -> tuple[dict, "object"]:
    """The base config's raw YAML (its sections are copied) and its parsed, checked RunConfig."""
    from lm.training.config import parse_run_config

    if base is None:
        return {}, parse_run_config([])[0]
    if not Path(base).is_file():
        raise UserError(f"base config {base} not found")
    raw = load_yaml(base) or {}
    return raw, parse_run_config(["--config", base])[0]


def sequences_per_step(run, global_batch: int | None) -> int:
    """--global_batch, else the base config's, else its micro-batch x accumulation x data-parallel size (the
    processes over strategy.context_parallel); checked to split into micro-batches over the base's replicas."""
    from lm.training.batch import global_batch_of, resolve_accumulation

    d, st = run.data, run.strategy
    world = max(1, (st.devices * st.num_nodes if isinstance(st.devices, int) else 1) // st.context_parallel)
    if global_batch is None:
        global_batch = global_batch_of(d.global_batch, d.global_batch_tokens, d.seq_len)
    if global_batch is None:
        global_batch = d.micro_batch * (run.trainer.accumulate or 1) * world
    if global_batch < 1:
        raise UserError(f"--global_batch must be positive, got {global_batch}")
    resolve_accumulation(global_batch, d.micro_batch, None, world)
    return global_batch


def lr_grid(lrs: list[float] | dict[str, list[float]] | None, archs: list[Arch], base_lr: float) -> dict:
    if lrs is None:
        return {a.label: [base_lr * m for m in LR_MULTIPLES] for a in archs}
    if isinstance(lrs, dict):
        lrs = {parse_archs([name])[0].label: grid for name, grid in lrs.items()}  # "mesa+attention" or its label
        missing = [a.label for a in archs if a.label not in lrs]
        if missing:
            raise UserError(f"--lrs has no grid for {', '.join(missing)}")
        grid = {a.label: list(lrs[a.label]) for a in archs}
    else:
        grid = {a.label: list(lrs) for a in archs}
    if any(not g or min(g) <= 0 for g in grid.values()):
        raise UserError("--lrs: every grid needs at least one positive learning rate")
    return grid


def sci(x: float) -> str:
    mantissa, exponent = f"{x:.3e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def count(n: float) -> str:
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.2f}{suffix}"
    return str(int(n))


def markdown(result: dict) -> str:
    columns = ("arch", "d_model", "n_layers", "n_heads", "head_dim", "mlp_ratio", "params", "params (no emb.)",
               "train FLOPs/token", "tokens", "steps", "total FLOPs", "error vs target", "move")
    lines = [f"# lm compare plan: matched {result['match']}", "", *result["notes"], "",
             "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for r in result["archs"]:
        m = r["model"]
        cells = (r["arch"], m["d_model"], m["n_layers"], m["n_heads"], m["head_dim"], f"{m['mlp_ratio']:.3f}",
                 count(r["params"]), count(r["params_non_embedding"]), sci(r["train_flops_per_token"]),
                 count(r["tokens"]), r["steps"], sci(r["total_flops"]), f"{r['error']:+.2%}", r["move"])
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def run_config(raw: dict, run, row: dict, lr: float, seed: int, global_batch: int, seq_len: int,
               run_dir: Path, data_path: str | None = None) -> dict:
    """The base config's sections with the planned model, batch, length, lr, seed and steps; its warmup cut to a
    tenth of the steps and its validation and checkpoint intervals to the steps where a short run needs it; its data
    (a path or a mixture) replaced by `data_path` where given."""
    steps = row["steps"]
    data = {k: v for k, v in (raw.get("data") or {}).items() if k != "global_batch_tokens"}
    if data_path is not None:
        data = {**{k: v for k, v in data.items() if k != "sources"}, "path": data_path}
    warmup = min(run.optim.warmup_steps, max(1, int(WARMUP_FRACTION * steps)))
    trainer = {**(raw.get("trainer") or {}), "max_steps": steps, "val_every": min(run.trainer.val_every, steps),
               "ckpt_every": min(run.trainer.ckpt_every, steps)}
    return {"run_dir": str(run_dir), "seed": seed, "model": row["model"],
            "data": {**data, "seq_len": seq_len, "global_batch": global_batch},
            "optim": {**(raw.get("optim") or {}), "lr": lr, "warmup_steps": warmup}, "trainer": trainer,
            "strategy": raw.get("strategy") or {}}


def plan(archs: str | list[str] | None = None, match: Literal["params", "flops"] = "params",
         budget: float | None = None, params: float | None = None, seq_len: int | None = None,
         vocab_size: int | None = None, base: str | None = None, global_batch: int | None = None,
         lrs: list[float] | dict[str, list[float]] | None = None, seeds: list[int] | None = None,
         out: str = "runs/compare", data: str | None = None, submit: bool = False, slurm: list[str] | None = None,
         dry_run: bool = False) -> dict:
    """Shapes matched in parameters or training FLOPs, the tokens a budget buys, and configs to train them.

    Args:
        archs: Comma-separated mixers, "+"-joined hybrid patterns (mesa+attention) or hybrid names (mesa_attention)
            (default: every mixer and named hybrid).
        match: "params": equal parameter counts; "flops": equal training FLOPs per token (within 2%).
        budget: Total training FLOPs of each run; without --params it also sets the size (20 tokens/parameter).
        params: Target parameter count, tied embedding included; without --budget: 20 tokens/parameter for all.
        seq_len: Training sequence length (default: the base config's data.seq_len).
        vocab_size: Embedding rows (default: the base config's model.vocab_size).
        base: An `lm train` YAML whose data/optim/trainer/strategy sections (and model options such as the logit
            cap) the configs keep (default: the paper's recipe: lm train's defaults, which are its length 2048 and
            AdamW schedule, with its 256 sequences per step).
        global_batch: Sequences per optimizer step (default: the base config's; without --base, the paper's 256).
        lrs: Peak learning rates: one grid for all, or a mapping arch -> grid (default: base lr x 0.5, 1, 2).
        seeds: Seeds per learning rate (default: [0]).
        out: Directory for plan.md, plan.json, configs/, sweep.yaml and the runs.
        data: The prepared data (an `lm prepare` directory) every run trains on: data.path of the configs
            (default: the base config's data, else lm train's default, data/prepared).
        submit: Submit OUT/sweep.yaml as a SLURM array (lm slurm submit --array).
        slurm: Further `lm slurm submit` options, e.g. ["--time=24:00:00", "--dry_run"].
        dry_run: Print the plan only; write and submit nothing.
    """
    arch_list = parse_archs(default_archs() if archs is None else archs)
    if match not in ("params", "flops"):
        raise UserError(f"--match must be params or flops, not {match!r}")
    if budget is None and params is None:
        raise UserError("give --budget (total training FLOPs), --params (target parameters), or both")
    if (budget is not None and budget <= 0) or (params is not None and params <= 0):
        raise UserError("--budget and --params must be positive")
    if not dry_run and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    raw, run = load_base(base)
    seq_len = seq_len or run.data.seq_len
    template = model_template(run, arch_list, seq_len, vocab_size)
    if base is None and global_batch is None:  # lm train's default is one micro-batch a step, not the paper's
        global_batch = PAPER_GLOBAL_BATCH
    batch = sequences_per_step(run, global_batch)
    grid = lr_grid(lrs, arch_list, run.optim.lr)
    seeds = [0] if seeds is None else list(seeds)
    if not seeds:
        raise UserError("--seeds needs at least one seed")

    notes = []
    if params is None:
        target = math.sqrt(budget / (6 * TOKENS_PER_PARAM))
        asked = f"--budget {budget:.3g}"
        notes.append(f"Target size from the budget at Chinchilla's {TOKENS_PER_PARAM} tokens/parameter: "
                     f"N = sqrt({sci(budget)} / {6 * TOKENS_PER_PARAM}) = {count(target)} parameters.")
    else:
        target, asked = float(params), f"--params {params:.3g}"
        notes.append(f"Target size: {count(target)} parameters (tied embedding included).")
    reference = reference_shape(template, target, asked)
    flops_of = lambda cfg: train_flops_per_token(cfg, seq_len)  # noqa: E731
    metric, goal = (param_count, target) if match == "params" else (flops_of, flops_of(reference))
    notes.append(f"Reference: attention, d_model {reference.d_model}, {reference.n_layers} layers, "
                 f"{reference.n_heads} heads of {reference.head_dim}; matched {match} within {TOLERANCE:.0%} of "
                 f"{count(goal) if match == 'params' else sci(goal) + ' train FLOPs/token'}.")
    tokens_per_step = batch * seq_len
    notes.append(f"seq_len {seq_len}, vocab {template.vocab_size}, global batch {batch} sequences = "
                 f"{tokens_per_step:,} tokens/step; " + (f"budget {sci(budget)} FLOPs per run." if budget else
                                                         f"{TOKENS_PER_PARAM} tokens per target parameter for all."))
    if (pieces := run.strategy.context_parallel) > 1:
        notes.append(f"Context parallel: each window split over {pieces} ranks of {seq_len // pieces:,} tokens "
                     f"(strategy.context_parallel), the global batch over the processes / {pieces} replicas; the "
                     "FLOPs are the whole window's.")
        check_layout(pieces, seq_len, what="the base's strategy.context_parallel", window="seq_len")

    rows = []
    for arch, cfg, move in matched_shapes(arch_list, reference, metric, goal):
        per_token = flops_of(cfg)
        tokens = round(budget / per_token) if budget else round(TOKENS_PER_PARAM * target)
        steps = round(tokens / tokens_per_step)
        if steps < 1:
            raise UserError(f"{asked} buys {arch.label} {tokens:,} tokens, less than one step of "
                            f"{tokens_per_step:,} tokens (global batch {batch} x seq_len {seq_len})")
        rows.append({"arch": arch.label, "layer_pattern": arch.layer_pattern, "move": move, "model": asdict(cfg),
                     "params": param_count(cfg), "params_non_embedding": param_count(cfg, embeddings=False),
                     "train_flops_per_token": per_token, "tokens": tokens, "steps": steps,
                     "trained_tokens": steps * tokens_per_step, "total_flops": tokens * per_token,
                     "error": metric(cfg) / goal - 1, "lrs": grid[arch.label], "configs": []})
        notes += [f"{arch.label}: {note}." for note in flops_notes(cfg)]
    result = {"match": match, "target_params": target, "budget": budget, "seq_len": seq_len,
              "vocab_size": template.vocab_size, "global_batch": batch, "seeds": seeds, "goal": goal,
              "tolerance": TOLERANCE, "notes": notes, "archs": rows}
    table = markdown(result)
    print(table, end="")
    if dry_run:
        return result
    return write_plan(result, raw, run, Path(out), table, submit, slurm or [], data)


def write_plan(result: dict, raw: dict, run, out: Path, table: str, submit: bool, slurm: list[str],
               data: str | None = None) -> dict:
    """plan.md, plan.json, one config per arch x lr x seed (checked by lm train's loader), sweep.yaml."""
    from lm.training.config import parse_run_config

    configs_dir = out / "configs"
    configs_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for row in result["archs"]:
        for lr in row["lrs"]:
            for seed in result["seeds"]:
                name = f"{row['arch']}-lr{lr:g}-seed{seed}"
                config = run_config(raw, run, row, lr, seed, result["global_batch"], result["seq_len"],
                                    out / "runs" / name, data)
                header = (f"# {row['arch']}: {row['params']:,} parameters, {sci(row['train_flops_per_token'])} train "
                          f"FLOPs/token, {row['tokens']:,} tokens in {row['steps']} steps.\n"
                          f"# Written by lm compare plan (matched {result['match']}; see {out / 'plan.md'}).\n")
                path = configs_dir / f"{name}.yaml"
                path.write_text(header + yaml.safe_dump(config, sort_keys=False))
                row["configs"].append(str(path))
                runs.append({"config": str(path)})
        try:
            parse_run_config(["--config", row["configs"][0]])
        except UserError as err:
            raise UserError(f"the written config {row['configs'][0]} does not load: {err}") from None
    (out / "plan.md").write_text(table)
    write_json(out / "plan.json", result, indent=1)
    sweep = out / "sweep.yaml"
    sweep.write_text(f"# lm slurm submit --array {sweep}: one array task per run.\n"
                     + yaml.safe_dump({"runs": runs}, sort_keys=False))
    print(f"wrote {out / 'plan.md'}, {out / 'plan.json'}, {len(runs)} configs in {configs_dir}, {sweep}")
    if submit:
        from lm.slurm.submit import submit_from_args

        submit_from_args(["--array", str(sweep), *slurm])
    return result

"""What `lm compare ladder` plans: each architecture's rungs (shapes matched by `lm compare plan`, the steps each
budget buys, the micro-batch the memory plan fits on a GPU), the runs of the lr sweep, the tokens each run reads
against the corpus, and the tables it prints before anything runs: the rungs, the data, and the planned GPU-hours."""

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from lm.compare.ladder_config import LadderSpec
from lm.compare.plan import count, matched_shapes, model_template, parse_archs, reference_shape, sci
from lm.util.errors import UserError
from lm.util.output import markdown_table

REFERENCES: dict[tuple[str, float], object] = {}  # (the template, a rung) -> its attention reference shape


@dataclass(frozen=True)
class Rung:
    """One architecture at one size (and, iso-FLOP, one budget): its planned model and its steps."""

    arch: str
    target: float  # target parameters
    budget: float | None  # total training FLOPs (iso-FLOP ladders)
    model: dict
    params: int
    flops_per_token: float
    steps: int
    val_every: int  # divides steps, so the last step is validated
    tokens: int  # steps x tokens per step
    micro_batch: int | None = None  # with the ladder file's gpu section: what the memory plan fits on one GPU
    activation_checkpointing: bool = False  # where no sequence fits without it

    @property
    def label(self) -> str:
        size = f"{self.target / 1e6:.3g}M" if self.target >= 1e6 else f"{self.target / 1e3:.3g}k"
        return size + (f"-C{sci(self.budget)}" if self.budget else "")

    def size(self, against: str) -> float:
        return self.model["d_model"] if against == "width" else self.params


@dataclass(frozen=True)
class Run:
    rung: Rung
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.rung.arch}-{self.rung.label}-lr{self.lr:.3g}-seed{self.seed}"


def rounded_lr(lr: float) -> float:
    return float(f"{lr:.3g}")


def aligned_steps(steps: int, val_every: int) -> tuple[int, int]:
    """(steps, val_every) with val_every dividing steps, so that the last step is validated, and at least the base's
    val_every: steps loses fewer than one step per validation interval."""
    intervals = max(1, steps // val_every)
    every = steps // intervals  # at least val_every
    return every * intervals, every


def memory_fit(spec: LadderSpec, cfg, seq_len: int, batch: int, name: str) -> tuple[int, bool]:
    """(micro_batch, activation checkpointing) on one GPU of the ladder file's gpu_gib by the memory plan
    (lm.accounting.memory): the largest power of two that fits and divides the global batch, without activation
    checkpointing where one sequence fits without it."""
    from lm.accounting.memory import largest_micro_batch

    gib = spec.gpu.gpu_gib * 2**30
    for checkpointing in (False, True):
        fits = largest_micro_batch(cfg, seq_len, gib, activation_checkpointing=checkpointing)
        if fits:
            micro = 1 << (min(fits, batch).bit_length() - 1)
            while batch % micro:
                micro //= 2
            return micro, checkpointing
    raise UserError(f"{name} does not fit one GPU of {spec.gpu.gpu_gib:g} GiB even with activation checkpointing "
                    f"(lm bench plan-memory)")


def plan_rungs(spec: LadderSpec, run, batch: int, names: list[str] | None = None) -> dict[str, list[Rung]]:
    """Each architecture's rungs, smallest first (iso-FLOP: by budget, then size), at `batch` sequences per step;
    `names`: the architectures as written (default: the file's, a chosen value at its reference)."""
    from lm.accounting.flops import param_count, train_flops_per_token
    from lm.compare.ladder_config import resolved

    if names is None:
        names = [resolved(n, spec.choose, spec.choose.reference if spec.choose else None) for n in spec.archs]
    archs = parse_archs(list(names))
    seq_len = run.data.seq_len
    tokens_per_step = batch * seq_len
    template = model_template(run, archs, seq_len, None)
    flops_of = lambda cfg: train_flops_per_token(cfg, seq_len)  # noqa: E731
    rungs = {arch.label: [] for arch in archs}
    for target in spec.rungs:
        key = (repr(template), target)  # the search is slow, and a ladder with a choice plans several times
        reference = REFERENCES.get(key) or REFERENCES.setdefault(key, reference_shape(template, target,
                                                                                      f"rung {target:g}"))
        metric, goal = (param_count, target) if spec.match == "params" else (flops_of, flops_of(reference))
        for arch, cfg, _ in matched_shapes(archs, reference, metric, goal):
            memory = memory_fit(spec, cfg, seq_len, batch, f"rung {target:g} of {arch.label}") if spec.gpu else ()
            per_token = flops_of(cfg)
            for budget in spec.budgets or [None]:
                tokens = budget / per_token if budget else spec.tokens_per_param * target
                if tokens < tokens_per_step:
                    raise UserError(f"rung {target:g} of {arch.label} buys {tokens:,.0f} tokens, less than one step "
                                    f"of {tokens_per_step:,}: raise the budget or lower the batch")
                steps, val_every = aligned_steps(round(tokens / tokens_per_step), run.trainer.val_every)
                rungs[arch.label].append(Rung(arch.label, target, budget, asdict(cfg), param_count(cfg), per_token,
                                              steps, val_every, steps * tokens_per_step, *memory))
    return {arch: sorted(rs, key=lambda r: (r.budget or 0, r.target)) for arch, rs in rungs.items()}


def swept(spec: LadderSpec, rungs: list[Rung]) -> list[Rung]:
    """The rungs the lr is swept on: the `lr.sweep_rungs` smallest sizes, or every size (iso-FLOP: each at the
    smallest budget, whose best lr the size's other budgets take)."""
    first_budget = rungs[0].budget
    return [r for r in rungs if r.budget == first_budget and r.target in spec.rungs[:spec.lr.swept(len(spec.rungs))]]


def check_rule_can_fit(spec: LadderSpec, rungs: dict[str, list[Rung]]) -> None:
    """A slope to fit needs swept rungs of two sizes (width: two d_models): known from the plan, before a run."""
    if spec.lr.slope is not None:
        return
    for arch, arch_rungs in rungs.items():
        sweep = swept(spec, arch_rungs)
        sizes = {rung.size(spec.lr.against) for rung in sweep}
        if len(sizes) < 2 and len(arch_rungs) > len(sweep):  # a rung left to carry the lr up to
            size = "d_model" if spec.lr.against == "width" else "size"
            raise UserError(f"{spec.path}: {arch}'s swept rungs share one {size} ({', '.join(f'{s:g}' for s in sizes)})"
                            f", so the lr rule's slope cannot be fitted: sweep more rungs, set lr.against: params, "
                            f"or fix lr.slope")


def sweep_runs(spec: LadderSpec, rungs: dict[str, list[Rung]]) -> list[Run]:
    """The runs of an lr grid (`lr.grid`): every lr at every swept rung, at the sweep's seed."""
    return [Run(rung, lr, spec.sweep_seed) for arch in rungs for rung in swept(spec, rungs[arch])
            for lr in spec.lr.grid]


def lrs_per_sweep(spec: LadderSpec) -> int:
    """The lrs a swept rung trains at the sweep's seed before any widening."""
    return len(spec.lr.grid) if spec.lr.grid is not None else len(spec.lr.factors)


@dataclass(frozen=True)
class Corpus:
    """What the runs read: the training tokens a run can read once (its windows of seq_len; None: not known)."""

    tokens: int | None
    where: str  # the data, or why its size is not known


def corpus_of(data: str | None, raw_base: dict, seq_len: int) -> Corpus:
    """The training split of the ladder's data (a prepared folder), else of the base config's data.path."""
    from lm.data_prep.shards import load_manifest
    from lm.training.data import count_windows

    base_data = raw_base.get("data") or {}
    if data is None and base_data.get("sources"):
        return Corpus(None, "a mixture of sources (not checked)")
    path = data or base_data.get("path")
    if not path or not (Path(path) / "manifest.json").is_file():
        return Corpus(None, f"{path or 'no data.path'} (no manifest.json here: not checked)")
    split = load_manifest(path, verify=False)["splits"].get("train") or {}
    return Corpus(count_windows(int(split.get("tokens", 0)), seq_len) * seq_len, str(path))


def check_data(spec: LadderSpec, rungs: dict[str, list[Rung]], corpus: Corpus) -> None:
    """A run that would read its corpus more than once is refused, unless the ladder file sets repeat_data."""
    if corpus.tokens is None or spec.repeat_data:
        return
    for rs in rungs.values():
        for r in rs:
            if r.tokens > corpus.tokens:
                raise UserError(f"{spec.path}: {r.arch} at rung {r.label} reads {count(r.tokens)} tokens, "
                                f"{r.tokens / corpus.tokens:.2f} epochs of the corpus's {count(corpus.tokens)} "
                                f"training tokens ({corpus.where}): lower tokens_per_param or the budget, or set "
                                f"repeat_data: true")


def target_needs(spec: LadderSpec, rungs: dict[str, list[Rung]], corpus: Corpus) -> str:
    """What the target compute would take at the ladder's tokens per parameter, against the corpus: per architecture,
    its train FLOPs per token taken as k x params (k from its largest rung), so C = k N x tpp N."""
    if spec.budgets or not spec.target_compute:
        return ""
    needs, runs_out = {}, {}
    for arch, rs in rungs.items():
        k = rs[-1].flops_per_token / rs[-1].params
        needs[arch] = spec.tokens_per_param * math.sqrt(spec.target_compute / (k * spec.tokens_per_param))
        if corpus.tokens:
            runs_out[arch] = k * corpus.tokens ** 2 / spec.tokens_per_param
    low, high = min(needs, key=needs.get), max(needs, key=needs.get)
    text = (f"The target, {sci(spec.target_compute)} FLOPs at {spec.tokens_per_param:g} tokens per parameter, needs "
            f"about {count(needs[low])} ({low}) to {count(needs[high])} ({high}) training tokens")
    if not corpus.tokens:
        return text + ".\n"
    first, last = min(runs_out, key=runs_out.get), max(runs_out, key=runs_out.get)
    short = [arch for arch, need in needs.items() if need > corpus.tokens]
    return (text + f", {needs[low] / corpus.tokens:.3g}x to {needs[high] / corpus.tokens:.3g}x the corpus's "
            f"{count(corpus.tokens)}; the corpus runs out at {sci(runs_out[first])} ({first}) to "
            f"{sci(runs_out[last])} ({last}) FLOPs" + (f": there, {', '.join(short)} can only be extrapolated to"
                                                       if short else "") + ".\n")


def data_order(spec: LadderSpec) -> str:
    return ("each run's own order (its seed)" if spec.data_seed is None else
            f"one order for every run (data_seed {spec.data_seed})")


def lr_plan(spec: LadderSpec, sweep_runs: int) -> str:
    lr = spec.lr
    where = (f"on the {lr.swept(len(spec.rungs))} smallest rung(s)" if lr.swept(len(spec.rungs)) < len(spec.rungs)
             else "at every rung")
    if lr.grid is not None:
        return f"lr grid {list(lr.grid)} {where} ({sweep_runs} sweep runs)"
    return (f"lr swept {where} at x{', x'.join(f'{f:g}' for f in lr.factors)} around the best lr of the rung below "
            f"(the smallest rung: around lr.start), widened by up to {lr.widen} lr(s) a side where the best lies at "
            f"an end ({sweep_runs} sweep runs before any widening)")


def plan_table(spec: LadderSpec, rungs: dict, corpus: Corpus | None = None) -> str:
    """The rungs (and the epochs of the corpus each reads), how many runs the ladder takes, what the planned FLOPs
    assume (Mesa's expected CG steps), and what the target would take."""
    from lm.accounting.flops import flops_notes
    from lm.model import LMConfig

    corpus = corpus or Corpus(None, "not known")
    header = ["arch", "rung", "d_model", "n_layers", "params", "train FLOPs/token", "tokens", "steps", "compute"]
    header += ["epochs of the corpus"] if corpus.tokens else []
    rows = [[r.arch, r.label, r.model["d_model"], r.model["n_layers"], f"{r.params:,}", sci(r.flops_per_token),
             count(r.tokens), r.steps, sci(r.flops_per_token * r.tokens)]
            + ([f"{r.tokens / corpus.tokens:.3g}"] if corpus.tokens else []) for rs in rungs.values() for r in rs]
    budget = (f"every architecture at {sci(spec.budgets[0])} FLOPs, one size each" if spec.budgets
              and len(spec.rungs) == 1 and len(spec.budgets) == 1 else
              f"iso-FLOP at {', '.join(sci(b) for b in spec.budgets)} FLOPs" if spec.budgets else
              f"{spec.tokens_per_param:g} tokens per target parameter")
    sweep_runs = sum(len(swept(spec, rs)) for rs in rungs.values()) * lrs_per_sweep(spec)
    runs = sweep_runs + sum(len(spec.seeds) * len(rs) for rs in rungs.values())
    notes = {f"{arch}: {note}." for arch, rs in rungs.items() for note in flops_notes(LMConfig(**rs[0].model))}
    choose = spec.choose
    chosen = (f" First, by measurement, {choose.arch}'s {choose.option} from {list(choose.values)} at rung "
              f"{choose.rung / 1e3:.3g}k, lr {choose.lr:g}, seeds {list(choose.seeds)} "
              f"({len(choose.values) * len(choose.seeds)} runs): the smallest shown to be at most {choose.tolerance:g} "
              f"nats above {choose.option} {choose.reference} (Welch's interval); until then the table plans it at "
              f"{choose.reference}."
              if choose else "")
    data = (f"Data: {corpus.where}, {count(corpus.tokens)} training tokens"
            + ("; repeat_data is set, so a run may read it more than once." if spec.repeat_data else
               "; no run reads it more than once.") if corpus.tokens else f"Data: {corpus.where}.")
    return (f"# lm compare ladder: {spec.path}\n\n{len(spec.rungs)} rungs x {len(spec.archs)} architectures, matched "
            f"{spec.match}, {budget}; {lr_plan(spec, sweep_runs)} at seed {spec.sweep_seed}; then seeds "
            f"{list(spec.seeds)} at each rung's best lr, reading the data in {data_order(spec)}: {runs} runs."
            f"{chosen}\n\n"
            + markdown_table(header, rows) + f"\n{data}\n" + target_needs(spec, rungs, corpus)
            + "".join(f"\n{note}\n" for note in sorted(notes)))


def mfu_of(gpu, model: dict) -> float | None:
    """The MFU measured for the model's mixer; a hybrid's is its slowest mixer's; None where one is unknown."""
    from lm.model import LMConfig

    values = [gpu.mfu.get(m, gpu.default_mfu) for m in set(LMConfig(**model).layer_mixers())]
    return None if None in values else min(values)


def gpu_hours_table(spec: LadderSpec, rungs: dict) -> str:
    """Per rung and per architecture: tokens/s per GPU = MFU x peak / train FLOPs per token (a third more FLOPs
    with activation checkpointing, which recomputes the forward pass), at the micro-batch the memory plan fits; the
    hours of every run of the ladder (the sweep's lrs, and each seed of each rung)."""
    gpu, rows, totals = spec.gpu, [], {}
    for arch, arch_rungs in rungs.items():
        mfu = mfu_of(gpu, arch_rungs[0].model)
        sweep = {r.label for r in swept(spec, arch_rungs)}
        totals[arch] = 0.0 if mfu is not None else None
        for r in arch_rungs:
            memory = [r.micro_batch, "yes" if r.activation_checkpointing else "no"]
            if mfu is None:
                rows.append([arch, r.label, *memory, "unknown", "", "", ""])
                continue
            tokens_per_s = mfu * gpu.peak_flops / (r.flops_per_token * (4 / 3 if r.activation_checkpointing else 1))
            hours = r.tokens / tokens_per_s / 3600
            runs = len(spec.seeds) + (lrs_per_sweep(spec) if r.label in sweep else 0)
            totals[arch] += runs * hours
            rows.append([arch, r.label, *memory, f"{mfu:.1%}", f"{tokens_per_s:,.0f}", f"{hours:,.1f}",
                         f"{runs} -> {runs * hours:,.0f}"])
    header = ["arch", "rung", f"micro_batch ({gpu.gpu_gib:g} GiB)", "activation ckpt", "MFU", "tokens/s per GPU",
              "GPU-hours per run", "runs -> GPU-hours"]
    known = {a: t for a, t in totals.items() if t is not None}
    return ("## Planned GPU-hours\n\n" + markdown_table(header, rows) + "\nGPU-hours per architecture: "
            + ", ".join(f"{a} {t:,.0f}" for a, t in known.items()) + f"; all: {sum(known.values()):,.0f}.\n\n")



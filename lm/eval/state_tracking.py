"""State tracking: parity and the word problems of S3 and S5 (`lm eval state-tracking`).

A sequence is a word of group elements x_1 .. x_T drawn uniformly; at every position the model predicts the running
product p_t = x_1 x_2 ... x_t (apply x_1 first). Parity is the word problem of S2 (a swap flips it, the identity keeps
it); S3 (6 elements, not abelian) and S5 (120, not solvable) are the permutation groups of the negative-eigenvalue
(Grazzi et al., arXiv 2411.12537) and DeltaProduct (Siems et al., arXiv 2502.10297) papers. A linear recurrence whose
state transitions have eigenvalues in [0, 1] cannot track parity at every length; a delta rule with beta in [0, 2]
reaches eigenvalue -1, and products of Householder steps reach the rotations S3 and S5 need.

Each model (a mixer, or a variant "mixer@option=value", e.g. "deltanet@beta_range=[0,2]") is trained on words of the
training length, every position scored, with fresh words every step, and tested on fresh words at the training length
and at 2x and 4x: the accuracy at the last position (the whole word's product), over `test_words` words per length.
Each model, task and seed is one job (lm.util.workers), so `--workers 2` uses both cores of a CPU machine.

Outputs under --out: runs/TASK/MODEL-sSEED.json (each run as it ends: a rerun with the same settings trains only
the runs missing), results.json (every run), state_tracking.md (the table: mean over seeds with min-max) and
state_tracking.png.
"""

import functools
import itertools
import json
import re
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lm.mixers import MIXERS, MixerOptionError
from lm.model import LanguageModel, LMConfig
from lm.util.errors import UserError
from lm.util.output import markdown_table, write_json
from lm.util.plotting import pyplot, save
from lm.util.workers import run_jobs

TASKS = {"parity": 2, "s3": 3, "s5": 5}  # task -> n of the permutation group S_n (parity: S2)
# The models of docs/state_tracking.md: the delta rules with beta in [0, 1] and in [0, 2], the Householder products of
# DeltaProduct (with its paper's beta in [0, 2]), and their neighbours.
DEFAULT_MODELS = ["attention", "mamba2", "mlstm", "deltanet", "deltanet@beta_range=[0,2]", "gated_deltanet",
                  "gated_deltanet@beta_range=[0,2]", "gated_deltaproduct@householder_steps=2@beta_range=[0,2]",
                  "gated_deltaproduct@householder_steps=3@beta_range=[0,2]", "kda", "mesa"]


@functools.cache
def group(n: int) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """(the multiplication table [n!, n!] of S_n, its elements): table[a, b] is the permutation a then b."""
    elements = list(itertools.permutations(range(n)))
    index = {p: i for i, p in enumerate(elements)}
    table = torch.tensor([[index[tuple(b[a[i]] for i in range(n))] for b in elements] for a in elements])
    return table, elements


def words(task: str, batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements [batch, length], running products [batch, length]) of uniformly drawn words."""
    table, elements = group(TASKS[task])
    x = torch.randint(len(elements), (batch, length), generator=generator)
    products = [x[:, 0]]
    for t in range(1, length):
        products.append(table[products[-1], x[:, t]])
    return x, torch.stack(products, dim=1)


def option_value(text: str):
    """A variant's option as written after `=`: JSON (a number, true/false, null, a list), else a word."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_model(spec: str) -> tuple[str, dict]:
    """(mixer, options) of "mixer" or "mixer@option=value@...", checked against the mixer's Options."""
    mixer, *items = spec.split("@")
    if mixer not in MIXERS:
        raise UserError(f"--models: unknown mixer {mixer!r} in {spec!r}; known: {', '.join(MIXERS)}")
    options = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise UserError(f"--models: {item!r} in {spec!r} is not OPTION=VALUE")
        options[key] = option_value(text)
    try:
        MIXERS[mixer].check_options(options)
    except MixerOptionError as err:
        raise UserError(f"--models: {spec}: {err}") from None
    return mixer, options


def build(task: str, mixer: str, options: dict, d_model: int, n_layers: int, n_heads: int, head_dim: int,
          max_len: int) -> LanguageModel:
    return LanguageModel(LMConfig(vocab_size=len(group(TASKS[task])[1]), d_model=d_model, n_layers=n_layers,
                                  n_heads=n_heads, head_dim=head_dim, mixer=mixer, mixer_options={mixer: options},
                                  max_seq_len=max_len, logit_soft_cap=None, mlp_ratio=2.0))


def last_accuracy(model: LanguageModel, task: str, length: int, count: int, generator: torch.Generator,
                  batch: int = 128) -> float:
    """The share of `count` fresh words of `length` whose whole product the model predicts at the last position."""
    right = 0
    with torch.no_grad():
        for start in range(0, count, batch):
            x, y = words(task, min(batch, count - start), length, generator)
            logits, _ = model(x)
            right += int((logits[:, -1].argmax(-1) == y[:, -1]).sum())
    return right / count


def train_one(task: str, spec: str, seed: int, length: int, steps: int, batch: int, lr: float, d_model: int,
              n_layers: int, n_heads: int, head_dim: int, test_words: int, multiples: tuple[int, ...]) -> dict:
    """Train one model on one task at one seed (AdamW, one-cycle schedule, fresh words every step, every position
    scored); its last-position accuracy at each multiple of the training length."""
    mixer, options = parse_model(spec)
    torch.manual_seed(seed)
    model = build(task, mixer, options, d_model, n_layers, n_heads, head_dim, length * max(multiples))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1)
    data = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(steps):
        x, y = words(task, batch, length, data)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    model.eval()
    test = torch.Generator().manual_seed(seed + 10_000)
    accuracy = {str(m): last_accuracy(model, task, m * length, test_words, test) for m in multiples}
    return {"task": task, "model": spec, "seed": seed, "length": length, "steps": steps, "lr": lr,
            "final_loss": loss.item(), "accuracy": accuracy, "params": model.num_params(),
            "seconds": time.perf_counter() - start}


def summarise(rows: list[dict], multiples: tuple[int, ...]) -> list[dict]:
    """Mean, min and max over seeds of each (task, model)'s accuracy at each multiple."""
    out = []
    for (task, spec), runs in itertools.groupby(sorted(rows, key=lambda r: (r["task"], r["model"])),
                                                key=lambda r: (r["task"], r["model"])):
        runs = list(runs)
        entry = {"task": task, "model": spec, "seeds": [r["seed"] for r in runs]}
        for m in multiples:
            values = [r["accuracy"][str(m)] for r in runs]
            entry[str(m)] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
                             "values": values}
        out.append(entry)
    return out


def table(summary: list[dict], models: list[str], tasks: list[str], multiples: tuple[int, ...]) -> str:
    """One row per model, one column per task and length: mean accuracy over seeds [min, max]."""
    found = {(s["task"], s["model"]): s for s in summary}
    header = ["model"] + [f"{task} {m}x" for task in tasks for m in multiples]
    rows = []
    for spec in models:
        cells = [spec]
        for task in tasks:
            for m in multiples:
                s = found.get((task, spec))
                cells.append("–" if s is None else f"{s[str(m)]['mean']:.1%} [{s[str(m)]['min']:.0%}, "
                                                   f"{s[str(m)]['max']:.0%}]")
        rows.append(cells)
    return markdown_table(header, rows)


def plot(summary: list[dict], models: list[str], tasks: list[str], multiples: tuple[int, ...], path: Path) -> None:
    """Per task, each model's mean accuracy (and the seeds' range) against the test length."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    found = {(s["task"], s["model"]): s for s in summary}
    for ax, task in zip(axes[0], tasks, strict=True):
        for spec in models:
            if (s := found.get((task, spec))) is None:
                continue
            means = [s[str(m)]["mean"] for m in multiples]
            line, = ax.plot(multiples, means, marker="o", label=spec)
            ax.fill_between(multiples, [s[str(m)]["min"] for m in multiples], [s[str(m)]["max"] for m in multiples],
                            color=line.get_color(), alpha=0.15)
        ax.axhline(1 / len(group(TASKS[task])[1]), color="grey", linestyle=":", linewidth=1)
        ax.set(title=task, xlabel="test length / training length", ylabel="last-position accuracy", ylim=(0, 1.02),
               xscale="log", xticks=list(multiples), xticklabels=[f"{m}x" for m in multiples])
        ax.minorticks_off()  # a log axis would label 3 as well
    axes[0][-1].legend(fontsize=7, loc="lower left")
    save(fig, path)


def run_file(out_dir: Path, name: str) -> Path:
    """Where the run `name` ("task/model/sSEED") keeps its row: one file per run, its model spec made a file name."""
    task, spec, seed = name.split("/")
    return out_dir / "runs" / task / (re.sub(r"[^A-Za-z0-9_.-]+", "_", spec) + f"-{seed}.json")


def shape_json(shape: dict) -> dict:
    """The settings as they read back from JSON (tuples as lists), so that a saved run compares equal."""
    return json.loads(json.dumps(shape))


def finished_run(out_dir: Path, name: str, shape: dict) -> dict | None:
    """The row of `name` saved by an earlier call with the same settings, else None (a changed setting retrains)."""
    path = run_file(out_dir, name)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:  # a run cut while writing: train it again
        return None
    row = saved.get("run", {})
    same = saved.get("settings") == shape_json(shape) and (row.get("task"), row.get("model"), f"s{row.get('seed')}") \
        == tuple(name.split("/"))
    return row if same else None


def state_tracking(tasks: list[str] = list(TASKS), models: list[str] = DEFAULT_MODELS,  # noqa: B006
                   seeds: list[int] = [0, 1, 2], length: int = 32, steps: int = 600, batch: int = 64,  # noqa: B006
                   lr: float = 3e-3, d_model: int = 32, n_layers: int = 1, n_heads: int = 2, head_dim: int = 16,
                   test_words: int = 256, multiples: list[int] = [1, 2, 4], workers: int = 2,  # noqa: B006
                   out: str = "runs/state-tracking") -> list[dict]:
    """Train a small model of each mixer on parity and the S3 and S5 word problems; its accuracy at the training
    length and at 2x and 4x.

    Args:
        tasks: Of parity, s3, s5.
        models: Mixers or variants "mixer@option=value@..." (values as JSON: "deltanet@beta_range=[0,2]").
        seeds: Seeds of the model and its data; each a run.
        length: Training length (words of this many elements).
        steps: Training steps per run (fresh words every step).
        batch: Words per step.
        lr: Peak learning rate (one-cycle).
        d_model: Width.
        n_layers: Layers.
        n_heads: Heads.
        head_dim: Key size per head.
        test_words: Test words per length.
        multiples: Test lengths, as multiples of the training length.
        workers: Runs at once, each in a process of one thread.
        out: Output directory (results.json, state_tracking.md, state_tracking.png).
    """
    if unknown := [t for t in tasks if t not in TASKS]:
        raise UserError(f"--tasks: unknown {', '.join(unknown)}; known: {', '.join(TASKS)}")
    for name, value in (("length", length), ("steps", steps), ("batch", batch), ("test_words", test_words),
                        ("workers", workers), ("n_layers", n_layers)):
        if value < 1:
            raise UserError(f"--{name} must be at least 1, got {value}")
    if not seeds or not multiples or min(multiples) < 1 or not lr > 0:
        raise UserError("--seeds and --multiples must be non-empty, multiples at least 1 and --lr positive")
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    for spec in models:  # every model built once, before any trains: a bad option or shape is one line
        mixer, options = parse_model(spec)
        try:
            build("parity", mixer, options, d_model, n_layers, n_heads, head_dim, length)
        except (MixerOptionError, ValueError) as err:
            raise UserError(f"--models: {spec}: {err}") from None
    multiples = tuple(multiples)
    shape = dict(length=length, steps=steps, batch=batch, lr=lr, d_model=d_model, n_layers=n_layers,
                 n_heads=n_heads, head_dim=head_dim, test_words=test_words, multiples=multiples)
    out_dir = Path(out)
    names = {f"{task}/{spec}/s{seed}": (task, spec, seed) for task in tasks for spec in models for seed in seeds}
    finished = {name: row for name in names if (row := finished_run(out_dir, name, shape)) is not None}
    if finished:
        print(f"lm eval state-tracking: {len(finished)} of {len(names)} runs already done in {out_dir / 'runs'}",
              flush=True)
    jobs = {name: functools.partial(train_one, *names[name], **shape) for name in names if name not in finished}

    def done(name: str, row: dict) -> None:
        path = run_file(out_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"settings": shape_json(shape), "run": row})  # a rerun skips it
        print(f"lm eval state-tracking: {name}: " + ", ".join(
            f"{m}x {row['accuracy'][str(m)]:.0%}" for m in multiples) + f" ({row['seconds']:.0f} s)", flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    trained = run_jobs(jobs, workers, done=done)
    rows = [finished[name] if name in finished else trained[name] for name in names]
    summary = summarise(rows, multiples)
    write_json(out_dir / "results.json", {"settings": {**shape, "seeds": seeds, "tasks": tasks}, "runs": rows,
                                          "summary": summary})
    text = table(summary, models, tasks, multiples)
    (out_dir / "state_tracking.md").write_text(text)
    plot(summary, models, tasks, multiples, out_dir / "state_tracking.png")
    print(text)
    print(f"wrote {out_dir / 'state_tracking.md'}, {out_dir / 'state_tracking.png'} and results.json")
    return rows

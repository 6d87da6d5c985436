"""In-context linear regression, the seed group's probe (von Oswald et al. 2023, "Transformers learn in-context by
gradient descent" and "Uncovering mesa-optimization algorithms in Transformers"; the MesaNet paper).

Each sequence draws its own W ~ N(0, I) of shape [y_dim, x_dim]; inputs x_t ~ N(0, I / x_dim), so that E|x|^2 = 1
and W x has unit variance per output; y_t = W x_t + noise * N(0, I). Token t carries (x_t, x_{t-1}, y_{t-1})
("paired", zeros at t = 0) or only (x_t, y_{t-1}) ("shifted": a layer must first bring x_{t-1} to y_{t-1}'s
token, by a short convolution or a second layer). The model predicts y_t at every position t, having seen the t
pairs before it: a linear read-in, the mixer's blocks, a linear read-out, MSE loss.

References, in closed form at every position n (= the number of pairs seen), as expected MSE per output:
- zero: predicts 0; 1 + noise^2 (the prior's loss).
- ridge: the posterior mean under the true prior, W_n = (sum y_i x_i^T)(sum x_i x_i^T + noise^2 I)^-1, which is
  Bayes-optimal; its loss is noise^2 (1 + E[x^T (S_n + noise^2 I)^-1 x]), S_n = sum x_i x_i^T, with the
  expectation over the inputs taken on `input_draws` seeded draws (no closed form for a Wishart's resolvent).
- gd: one gradient-descent step from W = 0 on the in-context loss (1/2) sum |y_i - W x_i|^2 with its best step size
  eta_n = 1 / ((n + d + 1) / d + noise^2); its loss is 1 + noise^2 - n / (n + d + 1 + d noise^2).
- least squares, where its expected loss is finite (n >= d + 2): noise^2 (1 + d / (n - d - 1)).
`tests/test_icl.py` checks each against Monte-Carlo estimates of the predictors themselves.

Blocks: "lm", the language model's block (pre-RMSNorm mixer with its defaults, pre-RMSNorm SwiGLU, a final norm);
"minimal", the seed papers' layer: x + mixer(x), nothing else, the mixer with its MINIMAL_OPTIONS (no short conv,
no q/k normalisation, no output norm).
"""

import csv
import math
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers import MIXERS
from lm.mixers.protocol import at_length
from lm.model import Block, LMConfig
from lm.util.errors import UserError
from lm.util.output import markdown_table, write_json
from lm.util.plotting import pyplot, save
from lm.util.report_section import write_section
from lm.util.workers import run_jobs

Token = Literal["paired", "shifted"]
BlockKind = Literal["minimal", "lm"]
# --quick (for `lm compare demo` and the tests): one minimal layer of each mixer on a smaller task.
QUICK = {"blocks": ["minimal"], "layers": [1], "x_dim": 5, "length": 20, "steps": 300}
# The options that make the seed papers' minimal layer of each mixer: whichever of a short convolution, q/k
# normalisation and an output norm the mixer has, turned off (a mixer not listed: its defaults).
MINIMAL_OPTIONS = {
    "mamba2": {"conv_size": 0, "output_norm": False},
    "deltanet": {"conv_size": 0, "qk_norm": False, "output_norm": False},
    "gated_deltanet": {"conv_size": 0, "qk_norm": False, "output_norm": False},
    "gla": {"output_norm": False},
    "mlstm": {"output_norm": False},
    "hawk": {"conv_size": 0},
    "mesa": {"conv_size": 0, "qk_norm": False, "output_norm": False},
}
# Further models of a mixer: a label -> the options that differ (none for a mixer not listed). Mesa without its solve
# (0 CG steps, o_t = G_t q_t) is gated linear attention: one such layer should do one GD step.
PROBE_VARIANTS = {"mesa": {"mesa, cg 0": {"cg_steps": 0}}}


@dataclass(frozen=True)
class RegressionTask:
    x_dim: int = 10
    y_dim: int = 1
    length: int = 50  # positions per sequence: predictions after 0 .. length - 1 pairs
    noise: float = 0.25  # standard deviation of the output noise (outputs have unit variance before it)
    token: Token = "paired"

    @property
    def token_dim(self) -> int:
        return self.x_dim * (2 if self.token == "paired" else 1) + self.y_dim


def regression_batch(task: RegressionTask, batch: int, generator: torch.Generator,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, T, token_dim], x [B, T, x_dim], y [B, T, y_dim]); tokens[:, t] holds x_t and the pair before."""
    B, T, d = batch, task.length, task.x_dim
    W = torch.randn(B, task.y_dim, d, generator=generator, dtype=dtype)
    x = torch.randn(B, T, d, generator=generator, dtype=dtype) / math.sqrt(d)
    y = x @ W.transpose(1, 2) + task.noise * torch.randn(B, T, task.y_dim, generator=generator, dtype=dtype)
    before = lambda z: F.pad(z, (0, 0, 1, 0))[:, :-1]  # noqa: E731  z_{t-1}, zero at t = 0
    parts = [x, before(x), before(y)] if task.token == "paired" else [x, before(y)]
    return torch.cat(parts, dim=-1), x, y


# --- the references ------------------------------------------------------------------------------------------------

def _pairs_seen(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What position t has seen: S_t = sum_{i<t} x_i x_i^T [B, T, d, d] and b_t = sum_{i<t} x_i y_i^T
    [B, T, d, y_dim]."""
    exclusive = lambda z: torch.cumsum(z, dim=1) - z  # noqa: E731
    return exclusive(x.unsqueeze(-1) * x.unsqueeze(-2)), exclusive(x.unsqueeze(-1) * y.unsqueeze(-2))


def ridge_predictions(x: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """y_hat_t = W_t x_t with W_t = b_t^T (S_t + lam I)^-1. lam 0 is least squares, defined once t >= d pairs are
    seen (nan before)."""
    S, b = _pairs_seen(x, y)
    first = x.shape[-1] if lam == 0 else 0
    S = S[:, first:] + lam * torch.eye(x.shape[-1], dtype=x.dtype)
    y_hat = (b[:, first:].transpose(-1, -2) @ torch.linalg.solve(S, x[:, first:].unsqueeze(-1))).squeeze(-1)
    return F.pad(y_hat, (0, 0, first, 0), value=torch.nan)


def gd_predictions(x: torch.Tensor, y: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """One GD step from W = 0: y_hat_t = eta_t b_t^T x_t, eta [T]."""
    _, b = _pairs_seen(x, y)
    return eta[:, None] * (b.transpose(-1, -2) @ x.unsqueeze(-1)).squeeze(-1)


def gd_step_size(task: RegressionTask) -> torch.Tensor:
    """The best step size at each position, [T] (float64): E[y y_hat] / E[y_hat^2] for y_hat = b^T x."""
    n, d = torch.arange(task.length, dtype=torch.float64), task.x_dim
    return 1.0 / ((n + d + 1) / d + task.noise**2)


def reference_curves(task: RegressionTask, input_draws: int = 4096, seed: int = 0) -> dict[str, torch.Tensor]:
    """Expected MSE per output at each position n = 0 .. length - 1, float64 [T] (nan where undefined)."""
    n, d, s2 = torch.arange(task.length, dtype=torch.float64), task.x_dim, task.noise**2
    x = torch.randn(input_draws, task.length, d, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64) / math.sqrt(d)
    S, _ = _pairs_seen(x, x[..., :1])
    resolvent_trace = torch.linalg.inv(S + s2 * torch.eye(d, dtype=torch.float64)).diagonal(dim1=-2, dim2=-1).sum(-1)
    least_squares = torch.where(n >= d + 2, s2 * (1 + d / (n - d - 1).clamp(min=1)), torch.nan)
    return {
        "ridge": s2 * (1 + resolvent_trace.mean(0) / d),  # E[x^T A x] = tr(A) / d for x ~ N(0, I / d)
        "gd": 1 + s2 - n / (n + d + 1 + d * s2),
        "least_squares": least_squares,
        "zero": torch.full_like(n, 1 + s2),
    }


# --- the models ------------------------------------------------------------------------------------------------------

class MinimalBlock(nn.Module):
    """The seed papers' layer: x + mixer(x), no norm, no MLP."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer

    def forward(self, x):
        return x + self.mixer(x)[0], None  # (x, state), as lm.model.Block


class RegressionModel(nn.Module):
    """Continuous tokens: a linear read-in, `n_layers` blocks of one mixer, a linear read-out."""

    def __init__(self, task: RegressionTask, mixer: str, options: dict, block: BlockKind, n_layers: int,
                 d_model: int, n_heads: int, head_dim: int):
        super().__init__()
        self.read_in = nn.Linear(task.token_dim, d_model)
        if block == "lm":
            cfg = LMConfig(vocab_size=1, d_model=d_model, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim,
                           mixer=mixer, mixer_options={mixer: options}, max_seq_len=task.length, mlp_ratio=2.0)
            self.blocks = nn.ModuleList(Block(cfg, i, mixer) for i in range(n_layers))
            self.norm = nn.RMSNorm(d_model, eps=cfg.norm_eps)
        else:
            self.blocks = nn.ModuleList(MinimalBlock(MIXERS[mixer](d_model, n_heads, head_dim, i, **options))
                                        for i in range(n_layers))
            self.norm = nn.Identity()
        self.read_out = nn.Linear(d_model, task.y_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.read_in(tokens)
        for block in self.blocks:
            h, _ = block(h)
        return self.read_out(self.norm(h))


@dataclass(frozen=True)
class Job:
    label: str  # the mixer, or a probe variant's label
    mixer: str
    options: dict
    block: BlockKind
    layers: int
    seed: int


def train_icl(job: Job, task: RegressionTask, d_model: int, n_heads: int, head_dim: int, steps: int, batch: int,
              lr: float, eval_sequences: int) -> dict:
    """Train one model with AdamW + one-cycle cosine on fresh sequences; its MSE per position on held-out ones."""
    torch.manual_seed(job.seed)
    model = RegressionModel(task, job.mixer, job.options, job.block, job.layers, d_model, n_heads, head_dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1)
    data = torch.Generator().manual_seed(job.seed)
    start = time.perf_counter()
    for _ in range(steps):
        tokens, _, y = regression_batch(task, batch, data)
        loss = F.mse_loss(model(tokens), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    seconds = time.perf_counter() - start
    model.eval()
    held_out, total = torch.Generator().manual_seed(10_000 + job.seed), torch.zeros(task.length, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(eval_sequences // batch):
            tokens, _, y = regression_batch(task, batch, held_out)
            total += ((model(tokens) - y) ** 2).mean(-1).sum(0).double()
    mse = total / (eval_sequences // batch * batch)
    return {**asdict(job), "mse": mse.tolist(), "final_loss": loss.item(), "seconds": seconds,
            "params": sum(p.numel() for p in model.parameters())}


def excess(mse: list[float], curve: torch.Tensor, start: int) -> tuple[float, float]:
    """(mean, max) over positions n >= start of (mse - curve) / curve."""
    relative = (torch.tensor(mse[start:], dtype=torch.float64) - curve[start:]) / curve[start:]
    return relative.mean().item(), relative.max().item()


# --- the command -----------------------------------------------------------------------------------------------------

def model_jobs(mixers: list[str], blocks: list[str], layers: list[int], seeds: list[int], length: int,
               mixer_options: dict[str, dict] | None = None) -> list[Job]:
    """Every mixer and probe variant in every block, depth and seed; the minimal block's options are the mixer's
    MINIMAL_OPTIONS, then the variant's, then `mixer_options`' for it, over its `length_options` at the task's
    length."""
    jobs = []
    for name in mixers:
        for label, variant in {name: {}, **PROBE_VARIANTS.get(name, {})}.items():
            for block in blocks:
                minimal = MINIMAL_OPTIONS.get(name, {}) if block == "minimal" else {}
                options = at_length(name, {**minimal, **variant,
                                           **(mixer_options or {}).get(name, {})}, length)
                jobs += [Job(label, name, options, block, n, seed) for n in layers for seed in seeds]
    return jobs


def check_args(mixers, blocks, layers, seeds, mixer_options, task: RegressionTask, d_model, n_heads, head_dim,
               sizes: dict[str, int], lr: float, out) -> None:
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown:
        raise UserError(f"unknown mixers {unknown}; known: {', '.join(MIXERS)}")
    if not set(blocks) <= {"minimal", "lm"} or not blocks:
        raise UserError(f"blocks must be among minimal, lm; got {blocks}")
    if not layers or min(layers) < 1 or not seeds:
        raise UserError(f"layers must be one or more depths of at least 1 and seeds not empty; got {layers}, {seeds}")
    if task.x_dim < 1 or task.y_dim < 1 or task.length <= task.x_dim or task.noise <= 0:
        raise UserError(f"the task needs x_dim, y_dim >= 1, length > x_dim and noise > 0; got {task}")
    if not lr > 0:
        raise UserError(f"--lr must be positive, got {lr}")
    small = [f"--{name} {value}" for name, value in sizes.items() if value < 1]
    if small or sizes["eval_sequences"] < sizes["batch"]:
        raise UserError(f"{', '.join(small) or '--eval_sequences'}: sizes must be at least 1, and eval_sequences "
                        f"at least batch")
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    # LMConfig checks a mixer's options
    for job in model_jobs(mixers, blocks, [1], seeds[:1], task.length, mixer_options):
        LMConfig(vocab_size=1, d_model=d_model, n_layers=1, n_heads=n_heads, head_dim=head_dim, mixer=job.mixer,
                 mixer_options={job.mixer: job.options})


def train_all(jobs: list[Job], processes: int, **train_args) -> list[dict]:
    """Each model in a worker process of one thread, `processes` at a time (the models are too small to gain from a
    second thread); in this process when `processes` is 1."""
    named = {f"model {i + 1}: {job.label} ({job.block}, {job.layers}L, seed {job.seed})":
             partial(train_icl, job, **train_args) for i, job in enumerate(jobs)}
    return list(run_jobs(named, processes).values())


def icl(mixers: list[str] | None = None, blocks: list[BlockKind] = ["minimal", "lm"],  # noqa: B006
        layers: list[int] = [1, 2], seeds: list[int] = [0], x_dim: int = 10, length: int = 50,  # noqa: B006
        noise: float = 0.25, token: Token = "paired", mixer_options: dict[str, dict] | None = None,
        d_model: int = 32, n_heads: int = 2, head_dim: int = 16, steps: int = 1000, batch: int = 64, lr: float = 1e-2,
        eval_sequences: int = 4096, processes: int = 2,
        quick: bool = False, out: str = "reports/icl") -> list[dict]:
    """In-context linear regression: each mixer's loss by position against ridge (optimal) and one GD step.

    Small models of each mixer (minimal and language-model blocks, one and two layers), their MSE by position
    against the closed-form references: ridge (Bayes-optimal), one GD step at its best step size, least squares, zero.

    Args:
        mixers: Mixers to probe (default: every registered mixer, and their PROBE_VARIANTS).
        blocks: minimal (x + mixer(x), the mixer's MINIMAL_OPTIONS) and/or lm (the language model's block).
        layers: Depths to train.
        seeds: Seeds of each model and its data (more than one gives the spread).
        x_dim: Input dimension d.
        length: Positions per sequence (predictions after 0 .. length - 1 pairs).
        noise: Output noise standard deviation (outputs have unit variance before it).
        token: paired, (x_t, x_{t-1}, y_{t-1}); shifted, (x_t, y_{t-1}).
        mixer_options: Options per mixer on top of the block's (e.g. {mesa: {qk_norm: true}} for the minimal block
            with L2-normalised keys).
        d_model: Width.
        n_heads: Heads.
        head_dim: Key size per head.
        steps: Training steps per model.
        batch: Sequences per step (fresh ones every step).
        lr: Peak learning rate (AdamW, one-cycle cosine).
        eval_sequences: Held-out sequences for the MSE by position.
        processes: Models trained at a time, one thread each.
        quick: The minimal block, one layer, d 5, length 20, 300 steps, in place of those options (for `lm compare
            demo` and the tests).
        out: Output folder: icl.csv (MSE by position), icl.md (the table), icl.png, icl.json.
    """
    if quick:
        blocks, layers, x_dim, length, steps = (QUICK[key] for key in ("blocks", "layers", "x_dim", "length", "steps"))
    task = RegressionTask(x_dim=x_dim, length=length, noise=noise, token=token)
    mixers = list(MIXERS) if mixers is None else mixers
    sizes = {"d_model": d_model, "n_heads": n_heads, "head_dim": head_dim, "steps": steps, "batch": batch,
             "eval_sequences": eval_sequences, "processes": processes}
    check_args(mixers, blocks, layers, seeds, mixer_options, task, d_model, n_heads, head_dim, sizes, lr, out)
    jobs = model_jobs(mixers, blocks, layers, seeds, task.length, mixer_options)
    start = time.perf_counter()
    rows = train_all(jobs, processes, task=task, d_model=d_model, n_heads=n_heads, head_dim=head_dim, steps=steps,
                    batch=batch, lr=lr, eval_sequences=eval_sequences)
    wall = time.perf_counter() - start
    setup = {"task": asdict(task), "d_model": d_model, "n_heads": n_heads, "head_dim": head_dim, "steps": steps,
             "batch": batch, "lr": lr, "eval_sequences": eval_sequences, "wall_seconds": wall}
    write_outputs(Path(out), task, rows, setup)
    return rows


def summary(task: RegressionTask, rows: list[dict], curves: dict[str, torch.Tensor]) -> list[dict]:
    """One line per model (label, block, depth), seeds pooled: the excess over ridge and over one GD step, relative,
    over positions n >= x_dim (mean over positions, then mean and range over seeds; the max over positions)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["label"], row["block"], row["layers"]), []).append(row)
    lines = []
    for (label, block, layers), runs in groups.items():
        ridge = [excess(r["mse"], curves["ridge"], task.x_dim) for r in runs]
        gd = [excess(r["mse"], curves["gd"], task.x_dim) for r in runs]
        means = [m for m, _ in ridge]
        lines.append({"model": label, "block": block, "layers": layers, "seeds": len(runs),
                      "options": runs[0]["options"], "params": runs[0]["params"],
                      "over_ridge": sum(means) / len(means), "over_ridge_range": (min(means), max(means)),
                      "over_ridge_max": max(m for _, m in ridge), "over_gd": sum(m for m, _ in gd) / len(gd),
                      "seconds": sum(r["seconds"] for r in runs) / len(runs)})
    return lines


def summary_table(lines: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "block", "layers", "options", "params", "seeds", "excess over ridge (mean, n >= d)",
              "seed range", "worst position", "excess over 1 GD step", "seconds per model"]
    pct = lambda v: f"{100 * v:+.1f}%"  # noqa: E731
    rows = [[s["model"], s["block"], str(s["layers"]), ", ".join(f"{k} {v}" for k, v in s["options"].items()) or "-",
             f"{s['params']:,}", str(s["seeds"]), pct(s["over_ridge"]),
             "-" if s["seeds"] == 1 else f"{pct(s['over_ridge_range'][0])} .. {pct(s['over_ridge_range'][1])}",
             pct(s["over_ridge_max"]), pct(s["over_gd"]), f"{s['seconds']:.0f}"] for s in lines]
    return header, rows


def write_outputs(out: Path, task: RegressionTask, rows: list[dict], setup: dict) -> None:
    """icl.csv (MSE by position: every reference, every model averaged over its seeds), icl.md, icl.png, icl.json."""
    out.mkdir(parents=True, exist_ok=True)
    curves = reference_curves(task)
    lines = summary(task, rows, curves)
    columns = {name: curve.tolist() for name, curve in curves.items()}
    for line in lines:
        runs = [r for r in rows if (r["label"], r["block"], r["layers"]) == (line["model"], line["block"],
                                                                              line["layers"])]
        columns[f"{line['model']} ({line['block']}, {line['layers']}L)"] = [
            sum(values) / len(values) for values in zip(*(r["mse"] for r in runs))]
    with open(out / "icl.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["pairs seen", *columns])
        writer.writerows([[n, *(f"{c[n]:.6g}" for c in columns.values())] for n in range(task.length)])
    header, table = summary_table(lines)
    (out / "icl.md").write_text(
        f"In-context linear regression: d {task.x_dim}, {task.length} positions, noise {task.noise}, "
        f"{task.token} tokens; width {setup['d_model']}, {setup['n_heads']} heads of {setup['head_dim']}, "
        f"{setup['steps']} steps of {setup['batch']}, lr {setup['lr']}; MSE on {setup['eval_sequences']} held-out "
        f"sequences. Excess: (model - reference) / reference, averaged over positions n >= d "
        f"(ridge = Bayes-optimal).\n\n{markdown_table(header, table)}")
    write_json(out / "icl.json", {"setup": setup, "summary": lines, "runs": rows}, indent=1)
    draw_curves(out / "icl.png", task, curves, columns, lines)
    write_section(out, "In-context linear regression (lm eval icl)", header, table, ["icl.png"])
    print(f"lm eval icl: {len(rows)} models in {setup['wall_seconds']:.0f} s -> {out}/icl.md, icl.csv, icl.png",
          file=sys.stderr)
    print(markdown_table(header, table))


def draw_curves(path: Path, task: RegressionTask, curves: dict, columns: dict, lines: list[dict]) -> None:
    """Loss against the pairs seen, as the seed papers draw it: one panel per block and depth, the references in
    black, log scale."""
    plt = pyplot()
    panels = list(dict.fromkeys((s["block"], s["layers"]) for s in lines))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False, sharey=True)
    n = list(range(task.length))
    styles = {"ridge": "-", "gd": "--", "least_squares": ":", "zero": "-."}
    labels = {"ridge": "ridge (Bayes-optimal)", "gd": "1 GD step, best step size", "least_squares": "least squares",
              "zero": "zero"}
    for ax, (block, layers) in zip(axes[0], panels):
        for name, style in styles.items():
            ax.plot(n, curves[name].tolist(), style, color="black", lw=1.5, label=labels[name])
        for s in lines:
            if (s["block"], s["layers"]) == (block, layers):
                ax.plot(n, columns[f"{s['model']} ({block}, {layers}L)"], lw=1.2, label=s["model"])
        ax.set_yscale("log")
        ax.set_ylim(task.noise**2 * 0.8, (1 + task.noise**2) * 1.5)
        ax.axvline(task.x_dim, color="grey", lw=0.5)
        ax.set_title(f"{block} block, {layers} layer{'s' if layers > 1 else ''}")
        ax.set_xlabel("pairs seen")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MSE per output")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    save(fig, path)

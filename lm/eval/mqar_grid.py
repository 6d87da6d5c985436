"""MQAR in zoology's grid (Arora et al. 2023, "Zoology"): a 2-layer model of each mixer for every width and
number of key-value pairs, on fixed-length sequences, and its accuracy against its recurrent state size.

Each cell (mixer, width, pairs, lr, seed) trains one model and writes out/cells/NAME.json; cells already there are
not rerun, so a SLURM array (one cell per task, `--cell $SLURM_ARRAY_TASK_ID`) and a later call combine. Every call
then collects the cells written so far into out/grid.csv, out/grid.md and out/accuracy_vs_state.png.
"""

import csv
import itertools
import json
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lm.eval.mqar import MQARTask, mqar_batch, options_for, state_floats_per_layer
from lm.mixers import MIXERS
from lm.mixers.layers import ShortConv
from lm.mixers.protocol import at_length
from lm.model import LanguageModel, LMConfig
from lm.util.errors import UserError
from lm.util.output import markdown_table, write_atomically, write_json
from lm.util.plotting import pyplot, save
from lm.util.report_section import write_section
from lm.util.workers import run_jobs

# The tests' grid: tiny sizes, a second or so a cell. Batches of 16 rather than 8: scoring 2048 queries takes half
# the forward passes, and a cell's time goes down by a quarter.
QUICK = {"vocab": 32, "length": 24, "pairs": [2, 6], "widths": [16], "steps": 20, "batch": 16, "lrs": [3e-3]}
CSV_FIELDS = ["mixer", "options", "width", "pairs", "length", "vocab", "lr", "seed", "params", "state_floats",
              "state_grows", "steps", "steps_run", "accuracy", "final_loss", "seconds", "mlp", "conv", "gaps",
              "random_fill", "schedule", "early_stop"]


# How the cells train. Zoology's (the default, from its iclr24_zoology_figure2 configs, data/multiquery_ar.py and its
# newer configs): no MLP (its state mixer is the identity), a short convolution of 3 before every mixer (attention
# included), query gaps from a power law with random tokens between, AdamW + cosine decay, stopped early once the
# held-out accuracy reaches 99%. lm's own (`--protocol lm`): the language model's blocks (mixer + SwiGLU MLP),
# queries at uniform positions among filler tokens, a one-cycle schedule for all the steps.
LM_PROTOCOL = {"mlp": True, "conv": 0, "gaps": "uniform", "random_fill": False, "schedule": "one_cycle",
               "early_stop": None}
ZOOLOGY = {"mlp": False, "conv": 3, "gaps": "power", "random_fill": True, "schedule": "cosine", "early_stop": 0.99}
EARLY_STOP_EVERY = 50  # steps between the held-out checks of an early stop (256 queries each)


def grid_cells(mixers: list[str], widths: list[int], pairs: list[int], lrs: list[float], seeds: list[int],
               vocab: int, length: int, steps: int, batch: int, protocol: dict | None = None,
               mixer_options: dict[str, dict] | None = None) -> list[dict]:
    """Every cell of the grid, in a fixed order (the SLURM array index is a position in this list)."""
    return [{"name": f"{m}_d{w}_n{n}_lr{lr:g}_s{seed}", "mixer": m,
             "options": at_length(m, (mixer_options or {}).get(m, options_for(m)), length), "width": w, "pairs": n,
             "lr": lr, "seed": seed, "vocab": vocab, "length": length, "steps": steps, "batch": batch,
             **(protocol or LM_PROTOCOL)}
            for m, w, n, lr, seed in itertools.product(mixers, widths, pairs, lrs, seeds)]


class ConvThenMixer(nn.Module):
    """Zoology's newer blocks: a short causal convolution over the model width (no activation) before the mixer,
    attention included. The same forward(x, state, reset) -> (y, state) as a mixer."""

    def __init__(self, mixer: nn.Module, width: int, size: int):
        super().__init__()
        self.conv, self.mixer = ShortConv(width, size, activation=False), mixer

    def forward(self, x, state=None, reset=None):
        state = state or {}
        h, conv = self.conv(x, state.get("conv"), reset)
        y, inner = self.mixer(h, state.get("mixer"), reset)
        return y, {"conv": conv, "mixer": inner}


def build_model(cell: dict, task: MQARTask) -> LanguageModel:
    """The cell's 2-layer model: lm's blocks, without their MLP (mlp_ratio 0: the SwiGLU adds exactly zero) and with
    a convolution before each mixer where the protocol says so."""
    w = cell["width"]
    with warnings.catch_warnings():  # the empty MLP's init is a no-op, as it should be
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        model = LanguageModel(LMConfig(
            vocab_size=task.vocab, d_model=w, n_layers=2, n_heads=2, head_dim=w // 2, mixer=cell["mixer"],
            mixer_options={cell["mixer"]: cell["options"]}, max_seq_len=task.seq_len, logit_soft_cap=None,
            mlp_ratio=2.0 if cell["mlp"] else 0.0))
    if cell["conv"]:
        for block in model.blocks:
            block.mixer = ConvThenMixer(block.mixer, w, cell["conv"])
    return model


def held_out_accuracy(model: LanguageModel, task: MQARTask, batch: int, seed: int, queries: int,
                      device: str) -> float:
    """Accuracy on fresh sequences of a generator seeded with `seed`, in whole batches until `queries` are scored."""
    test, correct, total = torch.Generator().manual_seed(seed), 0, 0
    with torch.no_grad():
        while total < queries:
            inputs, targets = (t.to(device) for t in mqar_batch(task, batch, test))
            scored = targets != -100
            correct += (query_logits(model, inputs, scored).argmax(-1) == targets[scored]).sum().item()
            total += scored.sum().item()
    return correct / total


def query_logits(model: LanguageModel, inputs: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """The model's logits at the scored positions only: the vocabulary-wide head at all 128+ positions would cost
    more than the 2-layer body (the forward of LanguageModel, without a soft cap)."""
    x = model.embed(inputs)
    for block in model.blocks:
        x, _ = block(x)
    return F.linear(model.norm(x)[scored], model.embed.weight)


def run_cell(cell: dict, path: str | None = None) -> dict:
    """Train the cell's model (AdamW with weight decay 0.1, fresh sequences every step; the protocol's schedule and
    early stop), score it on fresh ones; write the row to `path` (atomically: a killed job leaves no half-written
    cell)."""
    torch.manual_seed(cell["seed"])
    task = MQARTask(vocab=cell["vocab"], pairs=cell["pairs"], length=cell["length"], gaps=cell["gaps"],
                    random_fill=cell["random_fill"])
    model = build_model(cell, task)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a SLURM array task may have a GPU
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cell["lr"], weight_decay=0.1)
    schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cell["steps"]) if cell["schedule"] == "cosine"
                else torch.optim.lr_scheduler.OneCycleLR(optimizer, cell["lr"], total_steps=cell["steps"],
                                                         pct_start=0.1))
    data = torch.Generator().manual_seed(cell["seed"])
    start, steps_run = time.perf_counter(), 0
    for step in range(1, cell["steps"] + 1):
        inputs, targets = (t.to(device) for t in mqar_batch(task, cell["batch"], data))
        scored = targets != -100
        loss = F.cross_entropy(query_logits(model, inputs, scored), targets[scored])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        steps_run = step
        if cell["early_stop"] is not None and step % EARLY_STOP_EVERY == 0:
            model.eval()  # held-out sequences of their own seed, not the final scoring's
            reached = held_out_accuracy(model, task, cell["batch"], cell["seed"] + 20_000, 256, device)
            model.train()
            if reached >= cell["early_stop"]:
                break
    model.eval()
    accuracy = held_out_accuracy(model, task, cell["batch"], cell["seed"] + 10_000, 2048, device)
    with torch.no_grad():
        model.cpu()
        state = state_floats_per_layer(model, task.length)
        grows = state_floats_per_layer(model, 2 * task.length) > state  # a KV cache
    row = {**cell, "params": model.num_params(), "state_floats": state, "state_grows": grows,
           "accuracy": accuracy, "final_loss": loss.item(), "steps_run": steps_run,
           "seconds": round(time.perf_counter() - start, 1)}
    if path:
        write_json(Path(path), row, indent=1)
    return row


def mqar_grid(out: str = "runs/mqar_grid", mixers: list[str] | None = None, vocab: int = 128, length: int = 64,
              pairs: list[int] | None = None, widths: list[int] | None = None, steps: int = 1000,
              batch: int = 32, lrs: list[float] | None = None, seeds: list[int] | None = None, processes: int = 2,
              cell: int | None = None, quick: bool = False, protocol: str = "zoology", mlp: bool | None = None,
              conv: int | None = None, gaps: str | None = None, random_fill: bool | None = None,
              schedule: str | None = None, early_stop: float | None = None,
              mixer_options: dict[str, dict] | None = None) -> list[dict]:
    """MQAR in zoology's grid: accuracy of a 2-layer model of each mixer against its state size per layer.

    The default grid is zoology's protocol at a size 2 CPU cores train in under half an hour (docs/mqar.md): every
    registered mixer, vocab 128, length 64, pairs 8/16, widths 16/32, up to 1000 steps of 32 sequences at lrs 3e-3
    and 1e-2, seed 0 (72 cells). Attention at width 32 solves its hardest cell, and mixers of equal state part by
    far more than 20 points. Zoology's own grid is `--vocab 8192 --length 256 --pairs [8,16,32,64] --widths
    [32,64,128]` with many more steps and `--lrs [3e-4,1e-3,3e-3,1e-2]`, for SLURM: an array of one cell per task
    (`lm slurm submit --kind eval --tasks N -- mqar-grid ...`, N from `lm eval mqar-grid ... --cell -1`).

    Args:
        out: Directory of the results: cells/ (one JSON per cell), grid.csv, grid.md, accuracy_vs_state.png.
        mixers: Mixers (default: every registered mixer, with its `lm eval mqar` options, OPTIONS in lm/eval/mqar.py).
        vocab: Vocabulary (keys from the lower half, values from the upper half; zoology's is 8192).
        length: Tokens per sequence: the 2n context tokens, then the n queries at random positions among filler.
        pairs: Numbers of key-value pairs (default [8, 16]; each key queried once); the context and the queries
            must fit the length.
        widths: Model widths (default [16, 32]; d_model, with 2 heads of width/2).
        steps: Training steps per cell (fresh sequences every step), fewer where the early stop ends it.
        batch: Sequences per step.
        lrs: Peak learning rates (default [3e-3, 1e-2]; quick: [3e-3]); the tables keep each cell's best, as zoology
            does.
        seeds: Seeds of model and data (default [0]); the tables give the mean (and the range).
        processes: Cells run in parallel, each in a fresh process of one thread.
        cell: Run only this cell (0 .. cells - 1, the SLURM array index); -1: print the number of cells and stop.
        quick: A tiny grid for tests (vocab 32, length 24, pairs 2/6, width 16, 20 steps of 16, one lr): a second or
            so a cell.
        protocol: How cells train: "zoology" (the default: no MLP, a convolution of 3 before every mixer, power-law
            query gaps among random tokens, cosine decay, early stop at 99%) or "lm" (lm's blocks with their MLP,
            uniform query positions among filler, one-cycle schedule). The options below override single parts of
            it.
        mlp: Blocks with their SwiGLU MLP (zoology: none).
        conv: A short causal convolution of this size before every mixer, 0 for none (zoology: 3).
        gaps: Where queries go after the context: "uniform" or "power" (zoology's power law, a = 0.01).
        random_fill: Random tokens, not the filler 0, between the queries (zoology).
        schedule: "one_cycle" (10% warmup, then cosine) or "cosine" (cosine decay from the peak, zoology).
        early_stop: Stop a cell once its accuracy on 256 held-out queries, checked every 50 steps, reaches this
            (zoology: 0.99).
        mixer_options: Options per mixer, instead of its OPTIONS in lm/eval/mqar.py (e.g. {mesa: {norm_init: 1.0}});
            cells are named without them, so a grid with other options needs its own --out.
    """
    if quick:
        vocab, length, pairs, widths, steps, batch = (QUICK[k] for k in
                                                     ("vocab", "length", "pairs", "widths", "steps", "batch"))
        lrs = lrs or QUICK["lrs"]
    pairs, widths, lrs, seeds = pairs or [8, 16], widths or [16, 32], lrs or [3e-3, 1e-2], seeds or [0]
    mixers = list(MIXERS) if mixers is None else mixers
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown:
        raise UserError(f"unknown mixers {unknown}; known: {', '.join(MIXERS)}")
    if steps < 20 or batch < 1 or processes < 1 or min(widths) < 2 or any(w % 2 for w in widths):
        raise UserError("need steps >= 20 (the one-cycle warmup), batch >= 1, processes >= 1 and even widths")
    if not mixers:
        raise UserError("--mixers names no mixer")
    if min(pairs) < 1 or not all(lr > 0 for lr in lrs):
        raise UserError(f"--pairs must be at least 1 and --lrs positive, got {pairs} and {lrs}")
    if protocol not in ("lm", "zoology"):
        raise UserError(f"--protocol must be lm or zoology, got {protocol!r}")
    overrides = {"mlp": mlp, "conv": conv, "gaps": gaps, "random_fill": random_fill, "schedule": schedule,
                 "early_stop": early_stop}
    chosen = {**(ZOOLOGY if protocol == "zoology" else LM_PROTOCOL),
              **{k: v for k, v in overrides.items() if v is not None}}
    if chosen["schedule"] not in ("one_cycle", "cosine") or chosen["conv"] < 0 or not (
            chosen["early_stop"] is None or 0 < chosen["early_stop"] <= 1):
        raise UserError(f"--schedule must be one_cycle or cosine, --conv 0 or more, --early_stop in (0, 1]; got "
                        f"{chosen['schedule']!r}, {chosen['conv']}, {chosen['early_stop']}")
    for n in pairs:
        try:
            MQARTask(vocab=vocab, pairs=n, length=length, gaps=chosen["gaps"])
        except ValueError as err:
            raise UserError(f"--pairs {n}: {err}") from None
    for m, options in (mixer_options or {}).items():
        if m not in mixers:
            raise UserError(f"--mixer_options names {m!r}, which is not among --mixers")
        try:
            MIXERS[m].check_options(options)
        except ValueError as err:
            raise UserError(f"--mixer_options: {err}") from None
    cells = grid_cells(mixers, widths, pairs, lrs, seeds, vocab, length, steps, batch, chosen, mixer_options)
    if cell == -1:
        print(len(cells))
        return []
    if cell is not None and not 0 <= cell < len(cells):
        raise UserError(f"--cell {cell} is out of range: this grid has {len(cells)} cells (0 .. {len(cells) - 1})")
    directory = Path(out)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    done = read_cells(directory)
    for c in cells:  # a cell of another grid under the same name would mix two grids in one table
        old = done.get(c["name"])
        if old and any(old.get(k) != v for k, v in c.items()):
            raise UserError(f"{directory / 'cells' / c['name']}.json was run with other settings "
                            f"({', '.join(k for k, v in c.items() if old.get(k) != v)}): use another --out")

    todo = [c for c in ([cells[cell]] if cell is not None else cells) if c["name"] not in done]
    (directory / "cells").mkdir(parents=True, exist_ok=True)
    paths = [str(directory / "cells" / f"{c['name']}.json") for c in todo]
    # The costliest first, so that two processes end together: wide models, many pairs.
    order = sorted(range(len(todo)), key=lambda i: -todo[i]["width"] * todo[i]["steps"])
    start = time.perf_counter()
    run_jobs({todo[i]["name"]: partial(run_cell, todo[i], paths[i]) for i in order}, processes,
             done=lambda name, row: report(row, start))
    rows = [r for c in cells if (r := read_cells(directory).get(c["name"]))]
    write_outputs(directory, rows)
    print(f"lm eval mqar-grid: {len(rows)} of {len(cells)} cells done; wrote grid.csv, grid.md and "
          f"accuracy_vs_state.png in {directory}", file=sys.stderr)
    return rows


def report(row: dict, start: float) -> None:
    print(f"{row['name']}: accuracy {row['accuracy']:.1%}, loss {row['final_loss']:.3f}, {row['seconds']:.0f} s "
          f"(at {time.perf_counter() - start:.0f} s)", flush=True)


def read_cells(directory: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((directory / "cells").glob("*.json"))
            if not p.name.startswith(".")}  # not a cell being written


def summary(rows: list[dict]) -> dict[tuple, dict]:
    """(mixer, width, pairs) -> the best lr's mean accuracy over seeds, its range, params and state."""
    groups = {}
    for r in rows:
        groups.setdefault((r["mixer"], r["width"], r["pairs"]), {}).setdefault(r["lr"], []).append(r)
    cells = {}
    for key, by_lr in groups.items():
        runs = max(by_lr.values(), key=lambda rs: sum(r["accuracy"] for r in rs) / len(rs))
        accs = [r["accuracy"] for r in runs]
        cells[key] = {"accuracy": sum(accs) / len(accs), "low": min(accs), "high": max(accs), "lr": runs[0]["lr"],
                      "params": runs[0]["params"], "state": runs[0]["state_floats"],
                      "grows": runs[0]["state_grows"]}
    return cells


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Zoology's table: a row per mixer and width, a column per number of pairs (accuracy in %)."""
    cells = summary(rows)
    pairs = sorted({k[2] for k in cells})
    header = ["mixer", "width", "params", "state floats / layer"] + [f"{n} pairs" for n in pairs]
    body = []
    for mixer, width in sorted({k[:2] for k in cells}, key=lambda k: (list(MIXERS).index(k[0])
                                                                      if k[0] in MIXERS else 99, k)):
        first = next(cells[k] for k in cells if k[:2] == (mixer, width))
        entries = []
        for n in pairs:
            c = cells.get((mixer, width, n))
            entries.append("-" if c is None else f"{c['accuracy']:.1%}" + (
                f" ({c['low']:.0%}-{c['high']:.0%})" if c["high"] > c["low"] else ""))
        body.append([mixer, str(width), f"{first['params']:,}", f"{first['state']:,}" + ("*" if first["grows"]
                                                                                          else "")] + entries)
    return header, body


def write_outputs(directory: Path, rows: list[dict]) -> None:
    def write_csv(path: Path) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
            writer.writeheader()
            for r in rows:
                writer.writerow({**r, "options": json.dumps(r["options"]) if r["options"] else ""})

    write_atomically(directory / "grid.csv", write_csv)
    header, body = table(rows)
    r0 = rows[0] if rows else {}
    lines = [f"MQAR grid: vocab {r0.get('vocab')}, length {r0.get('length')}, 2 layers, {r0.get('steps')} steps of "
             f"{r0.get('batch')} sequences, lrs {sorted({r['lr'] for r in rows})}, seeds "
             f"{sorted({r['seed'] for r in rows})}. Accuracy on fresh sequences (best lr; mean over seeds, range).",
             "", markdown_table(header, body),
             "\\* a KV cache: the state grows with the length (here at the sequence's end)."]
    write_atomically(directory / "grid.md", lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    write_atomically(directory / "accuracy_vs_state.png", lambda tmp: plot(summary(rows), tmp))
    write_section(directory, "MQAR grid: accuracy against state size (lm eval mqar-grid)", header, body,
                  ["accuracy_vs_state.png"])


def plot(cells: dict[tuple, dict], path: Path) -> None:
    """Zoology's figure: a panel per number of pairs, accuracy against state size per layer, a line per mixer
    through its widths (dashed where the state is a KV cache, which grows with the length)."""
    plt = pyplot()
    pairs = sorted({k[2] for k in cells}) or [0]
    mixers = [m for m in list(MIXERS) + sorted({k[0] for k in cells} - set(MIXERS)) if any(k[0] == m for k in cells)]
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs), 3.8), sharey=True, squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, n in zip(axes[0], pairs):
        for i, m in enumerate(mixers):
            points = sorted((c["state"], c["accuracy"], c["grows"]) for k, c in cells.items()
                            if k[0] == m and k[2] == n)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors(i % 10),
                        linestyle="--" if points[0][2] else "-", label=m)
        ax.set_xscale("log")
        ax.set(title=f"{n} key-value pairs", xlabel="state floats per layer", ylim=(-0.03, 1.03))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    save(fig, path)

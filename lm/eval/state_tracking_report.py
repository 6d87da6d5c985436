"""What `lm eval state-tracking` reports: the lr each model's sweep chose, the seeds' accuracies (mean and range),
and the plots (accuracy against test length, accuracy by position, learning curves)."""

import itertools
import math
import statistics
from pathlib import Path

from lm.eval.state_tracking_words import chance, group
from lm.util.output import markdown_table
from lm.util.plotting import pyplot, save


def solved(row: dict) -> bool:
    return row["solved_step"] is not None


def sweep_score(row: dict) -> tuple:
    """How a sweep's run ranks (higher is better): solved first, and sooner; then the validation words' share right
    at every position, the last position's accuracy and the lower loss at the run's end. A diverged run ranks last."""
    if row["diverged"] or not row["curve"]:
        return (False, -math.inf, -1.0, -1.0, -math.inf)
    last = row["curve"][-1]
    return (solved(row), -row["steps"] if solved(row) else 0, last["val_word"], last["val_last"], -last["val_loss"])


def best_lr(rows: list[dict]) -> float:
    """The lr of the sweep's best run (sweep_score); among equals, the smaller lr."""
    return max(sorted(rows, key=lambda r: r["lr"]), key=sweep_score)["lr"]


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "values": values}


def summarise(rows: list[dict], multiples: list[int]) -> list[dict]:
    """Per (task, model), over its seeds: the lr, how many solved the training length, and the accuracy at each
    multiple (the last position's; and the share of words right at every position)."""
    out = []
    key = lambda r: (r["task"], r["model"])  # noqa: E731
    for (task, spec), runs in itertools.groupby(sorted(rows, key=key), key=key):
        runs = list(runs)
        out.append({"task": task, "model": spec, "lrs": sorted({r["lr"] for r in runs}),
                    "seeds": [r["seed"] for r in runs], "solved": sum(map(solved, runs)),
                    "diverged": sum(r["diverged"] for r in runs), "steps": [r["steps"] for r in runs],
                    "accuracy": {str(m): stats([r["accuracy"][str(m)] for r in runs]) for m in multiples},
                    "word_accuracy": {str(m): stats([r["word_accuracy"][str(m)] for r in runs]) for m in multiples}})
    return out


def cell(s: dict) -> str:
    return f"{s['mean']:.1%} [{s['min']:.1%}, {s['max']:.1%}]"


def results_table(summary: list[dict], task: str, models: list[str], multiples: list[int]) -> str:
    """One row per model of `task`: its lr, seeds that solved the training length, steps, and the last position's
    accuracy at each multiple, mean over seeds [min, max]."""
    found = {s["model"]: s for s in summary if s["task"] == task}
    header = ["model", "lr", "solved", "steps"] + [f"{m}x" for m in multiples]
    rows = []
    for spec in models:
        if (s := found.get(spec)) is None:
            rows.append([f"`{spec}`"] + ["–"] * (len(header) - 1))
            continue
        solved_cell = f"{s['solved']}/{len(s['seeds'])}" + (f" ({s['diverged']} diverged)" if s["diverged"] else "")
        rows.append([f"`{spec}`", ", ".join(f"{lr:g}" for lr in s["lrs"]), solved_cell,
                     ", ".join(map(str, s["steps"]))] + [cell(s["accuracy"][str(m)]) for m in multiples])
    return markdown_table(header, rows)


def sweep_cell(row: dict) -> str:
    if row["diverged"]:
        return "diverged"
    last = row["curve"][-1]
    return f"{last['val_last']:.0%}, loss {last['val_loss']:.3f}" + (f", solved @{row['steps']}" if solved(row) else "")


def sweep_table(sweeps: list[dict], task: str, models: list[str], lrs: list[float], chosen: dict) -> str:
    """One row per model of `task`: each lr's validation accuracy at the training length (last position) and loss at
    the run's end, the step it solved at, and the lr chosen."""
    found = {(r["model"], r["lr"]): r for r in sweeps if r["task"] == task}
    rows = [[f"`{spec}`"] + [sweep_cell(found[spec, lr]) if (spec, lr) in found else "–" for lr in lrs]
            + [f"{chosen[task, spec]:g}" if (task, spec) in chosen else "–"] for spec in models]
    return markdown_table(["model"] + [f"lr {lr:g}" for lr in lrs] + ["chosen"], rows)


NAMES = {"gated_deltaproduct": "GDP", "gated_deltanet": "GDN", "deltanet": "DeltaNet", "kda": "KDA", "mamba2": "Mamba2",
         "mlstm": "mLSTM", "mesa": "Mesa"}
OPTIONS = {"householder_steps": "n_h {}", "beta_range": "{}", "layers": "{} layers", "conv_size": "conv {}"}


def short(spec: str) -> str:
    """A model's label in a plot: "gated_deltaproduct@householder_steps=2@beta_range=[0,2]" is "GDP n_h 2 [0,2]"."""
    mixer, *items = spec.split("@")
    words = [NAMES.get(mixer, mixer)]
    for item in items:
        key, _, value = item.partition("=")
        words.append(OPTIONS.get(key, key + " {}").format(value))
    return " ".join(words)


def colours(n: int) -> list:
    plt = pyplot()
    return [plt.get_cmap("tab20")(i % 20) for i in range(n)]


def plot_lengths(summary: list[dict], models: dict[str, list[str]], multiples: list[int], path: Path) -> None:
    """Per task, each model's mean last-position accuracy (and the seeds' range) against the test length."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 6.5), squeeze=False)
    found = {(s["task"], s["model"]): s for s in summary}
    for ax, (task, specs) in zip(axes[0], models.items(), strict=True):
        for spec, colour in zip(specs, colours(len(specs)), strict=True):
            if (s := found.get((task, spec))) is None:
                continue
            acc = [s["accuracy"][str(m)] for m in multiples]
            ax.plot(multiples, [a["mean"] for a in acc], marker="o", label=short(spec), color=colour)
            ax.fill_between(multiples, [a["min"] for a in acc], [a["max"] for a in acc], color=colour, alpha=0.15)
        ax.axhline(chance(task), color="grey", linestyle=":", linewidth=1)
        ax.set(title=task, xlabel="test length / training length", ylabel="last-position accuracy", ylim=(0, 1.02),
               xscale="log", xticks=list(multiples), xticklabels=[f"{m}x" for m in multiples])
        ax.minorticks_off()  # a log axis would label 3 as well
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    save(fig, path)


def plot_by_position(rows: list[dict], models: dict[str, list[str]], length: int, path: Path) -> None:
    """Per task (columns): each model's accuracy at every position of the test words, mean over its seeds; top the
    share predicted right at that position, bottom the share right at every position up to it (the papers' plot).
    Dotted lines at 1x and 2x the training length."""
    plt = pyplot()
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 10), squeeze=False)
    for column, (task, specs) in enumerate(models.items()):
        for spec, colour in zip(specs, colours(len(specs)), strict=True):
            runs = [r for r in rows if r["task"] == task and r["model"] == spec]
            if not runs:
                continue
            for row, kind in enumerate(("token", "prefix")):
                mean = [statistics.fmean(v) for v in zip(*(r["by_position"][kind] for r in runs), strict=True)]
                axes[row][column].plot(range(1, len(mean) + 1), mean, label=short(spec), color=colour, linewidth=1)
        for row, what in enumerate(("accuracy at the position", "right at every position so far")):
            ax = axes[row][column]
            for m in (1, 2):
                ax.axvline(m * length, color="grey", linestyle=":", linewidth=1)
            if row == 0:
                ax.axhline(chance(task), color="grey", linestyle="--", linewidth=0.8)
            ax.set(title=f"{task}: {what}", xlabel="position", ylabel="share of test words", ylim=(0, 1.02))
        axes[1][column].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    save(fig, path)


def plot_curves(rows: list[dict], task: str, specs: list[str], solved_at: float, path: Path) -> None:
    """One panel per model of `task`: each seed's validation accuracy at the training length (last position, solid)
    and training loss over log |G| (dashed; 1 is a uniform guess) against the step."""
    plt = pyplot()
    columns = min(4, len(specs))
    rows_n = math.ceil(len(specs) / columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(4 * columns, 3 * rows_n), squeeze=False)
    scale = math.log(len(group(task)[1]))
    for ax, spec in zip(axes.flat, specs, strict=False):
        for run, colour in zip((r for r in rows if r["task"] == task and r["model"] == spec), colours(20),
                               strict=False):
            steps = [p["step"] for p in run["curve"]]
            ax.plot(steps, [p["val_last"] for p in run["curve"]], color=colour, label=f"s{run['seed']}")
            ax.plot(steps, [p["train_loss"] / scale for p in run["curve"]], color=colour, linestyle="--")
        ax.axhline(solved_at, color="grey", linestyle=":", linewidth=1)
        ax.set_title(short(spec), fontsize=9)
        ax.set(ylim=(0, 1.05), xlabel="step")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(specs):]:
        ax.axis("off")
    fig.suptitle(f"{task}: validation accuracy at the training length (solid), training loss / log|G| (dashed)")
    save(fig, path)

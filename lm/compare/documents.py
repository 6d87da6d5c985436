"""`lm compare documents`: what resetting at document boundaries (data.reset_at_documents) changes, per mixer, on a
2-core CPU. Each mixer trains twice per seed on the bundled corpus, once on windows that run across documents and
once with every document starting from an empty state, the same steps, data order and initialisation otherwise.
`lm eval ppl` then evaluates each run as it was trained (with resets or without), with positions counted from each
document's start for both, so the per-position curves share their x-axis.

Layout under --out: data/ (the prepared corpus), base.yaml, runs/MIXER-{carry,reset}-sSEED, logs/, documents.csv
(per mixer, setting and seed: val ppl, NLL at a few document positions), documents.md (means and seed ranges) and
documents.png (NLL by position in the document, mean over seeds).
"""

import csv
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import yaml

from lm.compare.demo import base_config, check_out_and_data, demo_lr, prepared_data, progress, train_and_evaluate
from lm.util.errors import UserError
from lm.util.output import write_json
from lm.util.workers import run_jobs

SETTINGS = ("carry", "reset")  # data.reset_at_documents false / true


def read_curve(run_dir: Path, seq_len: int) -> dict[int, tuple[float, int]]:
    """position -> (NLL, tokens) of a run's `lm eval ppl` output."""
    with open(run_dir / "eval" / f"ppl-validation-T{seq_len}" / "per_position.csv") as f:
        return {int(r["position"]): (float(r["nll"]), int(r["tokens"])) for r in csv.DictReader(f)}


def summarise(rows: list[dict], positions: list[int]) -> str:
    """documents.md's table: per mixer and setting, the mean over seeds and the range between them."""
    head = ["mixer", "setting", "val ppl (range over seeds)", *(f"NLL at {p}" for p in positions)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = {}
    for row in rows:
        groups.setdefault((row["mixer"], row["setting"]), []).append(row)
    for (mixer, setting), runs in groups.items():
        ppl = [r["ppl"] for r in runs]
        cells = [mixer, setting, f"{np.mean(ppl):.2f} ({min(ppl):.2f} to {max(ppl):.2f})"]
        cells += [f"{np.mean([r[f'nll@{p}'] for r in runs]):.3f}" for p in positions]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(curves: dict[tuple[str, str], dict[int, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixers = sorted({mixer for mixer, _ in curves})
    fig, axes = plt.subplots(1, len(mixers), figsize=(4.5 * len(mixers), 3.6), sharey=True, squeeze=False)
    for ax, mixer in zip(axes[0], mixers):
        for setting, style in zip(SETTINGS, ("--", "-")):
            curve = curves[(mixer, setting)]
            ax.plot(list(curve), list(curve.values()), style, marker=".", label=setting)
        ax.set(xscale="log", title=mixer, xlabel="position in the document")
        ax.legend()
    axes[0][0].set_ylabel("validation NLL (nats)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_documents(out: str = "runs/compare-documents", mixers: list[str] | None = None,
                      seeds: list[int] = [0, 1], steps: int = 300, seq_len: int = 256,  # noqa: B006
                      global_batch: int = 16, d_model: int = 64, n_layers: int = 2, vocab_size: int = 2048,
                      data: str | None = None, workers: int = 2, eval_windows: int | None = None) -> dict:
    """Every mixer given, trained with and without resets at document boundaries, and evaluated on the same axis.

    Args:
        out: Where everything goes (see the module docstring).
        mixers: Registered mixer names, each a model of its own (default: every one; docs/documents.md's demo names
            three in configs/compare/documents.yaml).
        seeds: Seeds of every setting (initialisation and data order); the table gives their range.
        steps: Optimizer steps of every run.
        seq_len: Training sequence length (the bundled corpus' documents are chapters of about a thousand tokens).
        global_batch: Sequences per optimizer step.
        d_model, n_layers: The models' width and depth (2 heads of d_model / 2).
        vocab_size: BPE vocabulary of the bundled corpus.
        data: An already prepared dataset to use instead of the bundled corpus.
        workers: Runs at once, each in its own process with cpu_count / workers threads.
        eval_windows: Validation windows, in training and in `lm eval ppl` (default: the whole validation split).
    """
    from lm.mixers import MIXERS
    from lm.mixers.protocol import at_length

    start = time.perf_counter()
    mixers = list(MIXERS) if mixers is None else mixers
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown or not mixers:
        raise UserError(f"--mixers: unknown {', '.join(unknown) or 'none given'}; known: {', '.join(sorted(MIXERS))}")
    for name, value in (("steps", steps), ("seq_len", seq_len), ("global_batch", global_batch), ("d_model", d_model),
                        ("n_layers", n_layers), ("workers", workers), ("eval_windows", eval_windows)):
        if value is not None and value < 1:
            raise UserError(f"--{name} must be at least 1, got {value}")
    if not seeds or d_model % 2:
        raise UserError("--seeds must name at least one seed and --d_model must be even")
    out_dir = Path(out)
    check_out_and_data(out_dir, data, vocab_size)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    data, vocab = prepared_data(out_dir, data, vocab_size)
    base = base_config(data, vocab, seq_len, global_batch, eval_windows)
    base["model"].update(d_model=d_model, n_layers=n_layers, n_heads=2, head_dim=d_model // 2)
    config = out_dir / "base.yaml"
    config.write_text(yaml.safe_dump(base, sort_keys=False))
    threads = max(1, (os.cpu_count() or 1) // workers)
    common = ["--trainer.max_steps", str(steps), "--trainer.val_every", str(steps), "--trainer.ckpt_every",
              str(steps), "--trainer.log_every", str(max(1, steps // 10)), "--optim.warmup_steps",
              str(max(1, steps // 10))]
    jobs = {}
    for mixer in mixers:
        for setting in SETTINGS:
            for seed in seeds:
                name = f"{mixer}-{setting}-s{seed}"
                # each run carries its own mixer's options alone (lm train refuses another mixer's)
                options = {mixer: at_length(mixer, {}, seq_len)} if MIXERS[mixer].length_options(seq_len) else {}
                overrides = ["--run_dir", str(out_dir / "runs" / name), "--model.mixer", mixer,
                             "--model.mixer_options", json.dumps(options), "--seed", str(seed),
                             "--data.seed", str(seed), "--optim.lr", str(demo_lr(mixer)),
                             "--data.reset_at_documents", str(setting == "reset").lower(), *common]
                # `lm eval ppl --positions document`: positions counted from each document's start
                jobs[name] = partial(train_and_evaluate, str(config), overrides, eval_windows, positions="document")
    print(f"lm compare documents: {len(jobs)} runs of {steps} steps, {workers} at a time", file=sys.stderr)
    run_jobs(jobs, workers, threads, logs={name: out_dir / "logs" / f"{name}.log" for name in jobs},
             done=progress("lm compare documents"))
    rows, table = write_summary(out_dir, mixers, seeds, seq_len,
                                f"{steps} steps of {global_batch} x {seq_len}, mean of {len(seeds)} seeds")
    wall = time.perf_counter() - start
    print(f"\n{table}\nlm compare documents: {wall:.0f} s in all; {out_dir / 'documents.md'}, documents.png")
    return {"rows": rows, "table": table, "wall_s": wall}


def write_summary(out_dir: Path, mixers: list[str], seeds: list[int], seq_len: int, title: str) -> tuple[list, str]:
    """documents.{csv,md,json,png} from the runs' `lm eval ppl` outputs: (rows, the markdown table)."""
    rows, curves = [], {}
    for mixer in mixers:
        for setting in SETTINGS:
            runs = [out_dir / "runs" / f"{mixer}-{setting}-s{seed}" for seed in seeds]
            by_seed = [read_curve(run, seq_len) for run in runs]
            # the evaluated (log-spaced) positions nearest to a few round ones
            positions = sorted({min(by_seed[0], key=lambda k: abs(k - p)) for p in (1, 2, 4, 16, 64, seq_len)})
            curves[(mixer, setting)] = {p: float(np.mean([c[p][0] for c in by_seed])) for p in by_seed[0]}
            for seed, run, curve in zip(seeds, runs, by_seed):
                ppl = json.loads((run / "eval" / f"ppl-validation-T{seq_len}" / "ppl.json").read_text())["ppl"]
                row = {"mixer": mixer, "setting": setting, "seed": seed, "ppl": ppl}
                row.update({f"nll@{p}": curve[p][0] for p in positions})
                row.update({f"tokens@{p}": curve[p][1] for p in positions})
                rows.append(row)
    with open(out_dir / "documents.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = summarise(rows, positions)
    (out_dir / "documents.md").write_text(table)
    plot(curves, out_dir / "documents.png", title)
    write_json(out_dir / "documents.json", {"rows": rows, "positions": positions})
    return rows, table

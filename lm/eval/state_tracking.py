"""State tracking: parity and the word problems of S3, A5 and S5 (`lm eval state-tracking`).

Each model (a mixer, or a variant "mixer@option=value", e.g. "deltanet@beta_range=[0,2]") reads words of group elements
and predicts the running product at every position (lm/eval/state_tracking_words.py). A linear recurrence whose state
transitions have eigenvalues in [0, 1] cannot track parity at every length; a delta rule with beta in [0, 2] reaches
eigenvalue -1, and products of Householder steps reach the rotations S3 and S5 need (Grazzi et al., arXiv 2411.12537;
Siems et al., arXiv 2502.10297).

What runs (lm/eval/state_tracking_settings.py): the defaults, or a preset (`--preset papers`,
configs/state_tracking/papers.yaml), with any setting given on the command line in its place. With several lrs, each
(task, model) first trains every lr at the sweep's seed, and then its seeds, fresh runs, at the lr whose run was best
(lm/eval/state_tracking_report.py's sweep_score); the sweep's runs are not seeds. Each run keeps its learning curve and
stops once it has solved the training length; it is tested at every position of longer words
(lm/eval/state_tracking_run.py).

Outputs under --out: runs/TASK/MODEL-sSEED.json and runs/TASK/sweep/MODEL-lrLR.json (each run as it ends, with its
settings: a rerun with the same settings trains only what is missing), results.json (the settings, every run, the
chosen lrs, the summary), state_tracking.md (the tables), state_tracking.png (accuracy against test length),
by_position.png and curves_TASK.png. Progress goes to stderr: a line at the start, one per point of a run's curve and
one per finished run.
"""

import dataclasses
import functools
import json
import re
import sys
import time
from pathlib import Path

from lm.eval.state_tracking_report import (
    best_lr,
    plot_by_position,
    plot_curves,
    plot_lengths,
    results_table,
    summarise,
    sweep_table,
)
from lm.eval.state_tracking_run import build, parse_model, train_one
from lm.eval.state_tracking_settings import Settings, load_preset, overridden
from lm.eval.state_tracking_words import TASKS
from lm.mixers import MIXERS, MixerOptionError
from lm.util.errors import UserError
from lm.util.output import write_json
from lm.util.workers import run_jobs, set_threads


def say(text: str) -> None:
    print(f"lm eval state-tracking: {text}", file=sys.stderr, flush=True)


def check(settings: Settings, out: str, workers: int) -> None:
    """Every setting and model checked (each model built once) before anything trains or is written."""
    if not settings.models:
        raise UserError("--tasks: no task to run")
    if unknown := [t for t in settings.models if t not in TASKS]:
        raise UserError(f"--tasks: unknown {', '.join(unknown)}; known: {', '.join(TASKS)}")
    for name in ("length", "batch", "d_model", "n_layers", "n_heads", "head_dim", "eval_every", "val_words",
                 "test_words"):
        if getattr(settings, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(settings, name)}")
    if workers < 1 or min(settings.max_steps.values()) < 1:
        raise UserError("--workers and --steps must be at least 1")
    if not settings.seeds or not settings.multiples or min(settings.multiples) < 1:
        raise UserError("--seeds and --multiples must be non-empty, multiples at least 1")
    if not settings.lrs or min(settings.lrs) <= 0 or len(set(settings.lrs)) != len(settings.lrs):
        raise UserError(f"--lrs must be distinct and positive, got {settings.lrs}")
    if len(settings.lrs) > 1 and settings.sweep_seed in settings.seeds:
        raise UserError(f"--sweep_seed {settings.sweep_seed} is one of --seeds {settings.seeds}: the sweep's runs "
                        f"are not seeds (give another)")
    if not 0 < settings.solved_at <= 1:
        raise UserError(f"--solved_at must be in (0, 1], got {settings.solved_at}")
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    for task, options in settings.options.items():
        if task not in settings.models:
            raise UserError(f"options for {task}, a task not run (tasks: {', '.join(settings.models)})")
        mixers = {parse_model(spec)[0] for spec in settings.models[task]}
        have = {f.name for mixer in mixers for f in dataclasses.fields(MIXERS[mixer].Options)}
        if unknown := sorted(set(options) - have):
            raise UserError(f"options for {task}: no model of it has {', '.join(unknown)}")
    for task, spec in dict.fromkeys((t, m) for t, models in settings.models.items() for m in models):
        try:
            build(task, spec, settings.d_model, settings.n_layers, settings.n_heads, settings.head_dim,
                  settings.mlp_ratio, settings.length, settings.options.get(task))
        except (MixerOptionError, ValueError) as err:
            raise UserError(f"--models: {spec}: {err}") from None


def file_name(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", spec)


def run_file(out_dir: Path, task: str, spec: str, seed: int, lr: float, sweep: bool) -> Path:
    """Where a run keeps its record: runs/TASK/MODEL-sSEED.json, a sweep's runs/TASK/sweep/MODEL-lrLR.json."""
    if sweep:
        return out_dir / "runs" / task / "sweep" / f"{file_name(spec)}-lr{lr:g}.json"
    return out_dir / "runs" / task / f"{file_name(spec)}-s{seed}.json"


def as_json(value) -> dict:
    """`value` as it reads back from JSON (tuples as lists), so that saved settings compare equal."""
    return json.loads(json.dumps(value))


def finished(path: Path, settings: dict) -> dict | None:
    """The run saved at `path` by an earlier call with the same settings, else None (a changed setting retrains)."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:  # a run cut while writing: train it again
        return None
    return saved["run"] if saved.get("settings") == as_json(settings) else None


def train_all(out_dir: Path, runs: list[tuple[str, str, int, float]], shapes: dict[str, dict], sweep: bool,
              workers: int, counter: list[int]) -> list[dict]:
    """Each run (task, model, seed, lr): its saved record, or trained now and saved as it ends. `counter`: [runs
    finished so far, all runs], for the progress lines."""
    rows, jobs, where = {}, {}, {}
    for task, spec, seed, lr in runs:
        name = f"{task}/{spec}/" + (f"lr{lr:g}" if sweep else f"s{seed}")
        settings = {**shapes[task], "task": task, "model": spec, "seed": seed, "lr": lr}
        where[name] = (run_file(out_dir, task, spec, seed, lr, sweep), settings)
        if (row := finished(*where[name])) is not None:
            rows[name] = row
        else:
            jobs[name] = functools.partial(train_one, task, spec, seed, lr, **shapes[task], name=name)

    def done(name: str, row: dict) -> None:
        path, settings = where[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"settings": as_json(settings), "run": row})  # a rerun skips it
        counter[0] += 1
        stop = (f"solved at step {row['solved_step']}" if row["solved_step"] else
                "diverged" if row["diverged"] else f"not solved in {row['steps']} steps")
        say(f"{name} (lr {row['lr']:g}) {stop}; " + ", ".join(f"{m}x {a:.0%}" for m, a in row["accuracy"].items())
            + f" ({row['cpu_seconds']:.0f} CPU-s) [{counter[0]} of {counter[1]} runs]")

    rows.update(run_jobs(jobs, workers, done=done))
    return [rows[name] for name in where]


def state_tracking(preset: str | None = None, tasks: list[str] | None = None, models: list[str] | None = None,
                   lrs: list[float] | None = None, seeds: list[int] | None = None, sweep_seed: int | None = None,
                   steps: int | None = None, length: int | None = None, batch: int | None = None,
                   d_model: int | None = None, n_layers: int | None = None, n_heads: int | None = None,
                   head_dim: int | None = None, eval_every: int | None = None, solved_at: float | None = None,
                   test_words: int | None = None, multiples: list[int] | None = None, workers: int = 1,
                   out: str = "runs/state-tracking") -> list[dict]:
    """Train a small model of each mixer on parity and the S3, A5 and S5 word problems: an lr sweep, seeds at the
    best lr, learning curves, and the accuracy at every position up to 4x the training length.

    Args:
        preset: Settings from configs/state_tracking/NAME.yaml ("papers": the negative-eigenvalue and DeltaProduct
            papers' setting, scaled to a CPU); none: the quick probe. Any option below given replaces its setting.
        tasks: Of parity, s3, a5, s5 (default: the preset's).
        models: Mixers or variants "mixer@option=value@..." (values as JSON: "deltanet@beta_range=[0,2]";
            "@layers=2" for two layers), for every task (default: the preset's, per task).
        lrs: Peak learning rates; several: a sweep at sweep_seed, then the seeds at the best.
        seeds: Seeds of the model and its data, each a run at the chosen lr.
        sweep_seed: The seed of the sweep's runs (not one of seeds).
        steps: The most training steps of a run, for every task (it stops once it has solved the training length).
        length: Training length (words of this many elements).
        batch: Words per step.
        d_model: Width.
        n_layers: Layers.
        n_heads: Heads.
        head_dim: Key size per head.
        eval_every: Steps between two points of the learning curve.
        solved_at: Share of validation words right at every position that stops a run.
        test_words: Test words (of the longest multiple).
        multiples: Test lengths, as multiples of the training length.
        workers: Runs at once, each in a process of one thread.
        out: Output directory.
    """
    settings = overridden(load_preset(preset), tasks, models, steps, lrs=lrs, seeds=seeds, sweep_seed=sweep_seed,
                          length=length, batch=batch, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                          head_dim=head_dim, eval_every=eval_every, solved_at=solved_at, test_words=test_words,
                          multiples=multiples)
    check(settings, out, workers)
    set_threads(1)  # a run in this process (one worker) takes one thread, as a worker's does
    out_dir = Path(out)
    shapes = {task: settings.run_shape(task) for task in settings.models}
    pairs = [(task, spec) for task, specs in settings.models.items() for spec in specs]
    swept = len(settings.lrs) > 1
    sweep_runs = [(t, s, settings.sweep_seed, lr) for t, s in pairs for lr in settings.lrs] if swept else []
    counter = [0, len(sweep_runs) + len(pairs) * len(settings.seeds)]
    say(f"{preset or 'default'} settings: {len(settings.models)} task(s), {len(pairs)} (task, model) pairs; "
        + (f"an lr sweep ({', '.join(f'{lr:g}' for lr in settings.lrs)}) at seed {settings.sweep_seed}, then "
           if swept else f"lr {settings.lrs[0]:g}, ")
        + f"seeds {settings.seeds}: {counter[1]} runs, {workers} worker(s); writing to {out_dir}")
    start = time.perf_counter()
    sweeps, rows, chosen = [], [], {}
    for task, spec in pairs:  # a model's sweep, then its seeds: each model's results whole before the next one's
        pair_sweeps = train_all(out_dir, [r for r in sweep_runs if r[:2] == (task, spec)], shapes, True, workers,
                                counter)
        chosen[task, spec] = best_lr(pair_sweeps) if swept else settings.lrs[0]
        rows += train_all(out_dir, [(task, spec, seed, chosen[task, spec]) for seed in settings.seeds], shapes, False,
                          workers, counter)
        sweeps += pair_sweeps
    write_outputs(out_dir, settings, preset, sweeps, rows, chosen)
    say(f"{counter[0]} runs trained, {counter[1] - counter[0]} reused, in {time.perf_counter() - start:.0f} s")
    say(f"wrote {out_dir / 'state_tracking.md'}, results.json and the plots (state_tracking.png, by_position.png, "
        f"curves_TASK.png) in {out_dir}")
    return rows


def write_outputs(out_dir: Path, settings: Settings, preset: str | None, sweeps: list[dict], rows: list[dict],
                  chosen: dict) -> None:
    """results.json, state_tracking.md (per task: the runs' table, and the sweep's) and the plots."""
    summary = summarise(rows, settings.multiples)
    write_json(out_dir / "results.json", {
        "preset": preset, "settings": as_json(settings.__dict__),
        "chosen_lr": [{"task": t, "model": s, "lr": lr} for (t, s), lr in chosen.items()],
        "summary": summary, "runs": rows, "sweep_runs": sweeps,
        "cpu_seconds": sum(r["cpu_seconds"] for r in rows + sweeps)})
    parts = []
    for task, specs in settings.models.items():
        parts.append(f"### {task}\n\nSeeds {settings.seeds} at the chosen lr. Last position's accuracy at each test "
                     f"length, mean [min, max]:\n\n" + results_table(summary, task, specs, settings.multiples))
        if len(settings.lrs) > 1:
            parts.append(f"The lr sweep (seed {settings.sweep_seed}): validation accuracy at the training length "
                         f"(last position) and loss at the run's end:\n\n"
                         + sweep_table(sweeps, task, specs, settings.lrs, chosen))
    text = "\n".join(parts)
    (out_dir / "state_tracking.md").write_text(text)
    plot_lengths(summary, settings.models, settings.multiples, out_dir / "state_tracking.png")
    plot_by_position(rows, settings.models, settings.length, out_dir / "by_position.png")
    for task, specs in settings.models.items():
        plot_curves(rows, task, specs, settings.solved_at, out_dir / f"curves_{task}.png")
    print(text)

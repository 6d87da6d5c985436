"""`lm compare ladder LADDER.yaml --out DIR`: architectures compared by what their runs show at matched compute, and by
fitted scaling curves judged on held-out rungs. The ladder file (lm/compare/ladder_config.py, configs/ladder/) names
the architectures, the rungs (sizes matched by `lm compare plan`), the budget of each rung (tokens per parameter, or
total FLOPs for iso-FLOP curves), the lr sweep, the seeds and the probes.

Before anything runs it prints the plan: the rungs, the tokens each reads against the corpus (a run that would read
it more than once is refused unless the file sets repeat_data), and what the target compute would need. Then it runs
in stages, each skipping what an earlier call finished, so a rerun resumes:
0. with `choose:`, an option chosen by measurement (Mesa's CG steps): each value at one rung and several seeds;
1. the lr sweep, rung by rung at the first seed: each rung sweeps the factors around the best lr of the rung below
   (lm/compare/lr_transfer.py), and a best lr at an end widens the sweep (or `lr.grid`: one fixed grid);
2. every rung at every seed, at its best lr (a rung not swept: the rule fitted over the swept ones);
3. the probes (`lm eval` commands) on each finished run of stage 2;
4. the report (lm/compare/ladder_report.py): verdicts at measured compute, fits judged by prediction, and curves read
   beyond the runs only as labelled extrapolations.

Each run is an ordinary `lm train` run (OUT/configs/NAME.yaml, OUT/runs/NAME). `--where local` trains them in worker
processes here; `--where slurm` submits each stage's unfinished runs as one array job (`lm slurm submit --array`:
requeued on preemption, resumed from its checkpoint) and, with `--wait true`, waits for it before going on; with
`--wait false` it returns after submitting, and the same command, run again when the job has ended, goes on.
"""

import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Literal

import yaml

from lm.compare.ladder_config import LadderSpec, load_ladder, resolved
from lm.compare.ladder_plan import (
    Corpus,
    Run,
    Rung,
    check_data,
    check_rule_can_fit,
    corpus_of,
    gpu_hours_table,
    plan_rungs,
    plan_table,
    rounded_lr,
    sweep_runs,
    swept,
)
from lm.compare.ladder_progress import StageProgress
from lm.compare.ladder_records import check_code
from lm.compare.lr_transfer import LrRule, best_lr, fit_rule, widening
from lm.compare.plan import load_base, run_config, sequences_per_step
from lm.util.errors import Diverged, UserError
from lm.util.output import write_json
from lm.util.workers import Stopped, run_jobs

POLL_SECONDS = 2.0
DIVERGED = "diverged"  # a file in a run directory whose training diverged: it ended, with no final loss


def final_loss(run_dir: Path) -> float:
    """The last validation loss of a finished run (inf for a diverged one)."""
    from lm.compare.run_results import read_run

    if (run_dir / DIVERGED).is_file():
        return math.inf
    loss = read_run(str(run_dir)).val_loss
    return math.inf if loss is None or not math.isfinite(loss) else loss


def sweep_record(spec: LadderSpec, rung: Rung, losses: dict[float, float], first: list[float]) -> dict:
    """One swept rung: its losses by lr at the first seed, its best lr (the vertex) and how it was found, the best lr
    it trained (its seeds' lr), and the lrs it started from (before any widening)."""
    vertex, how = best_lr(losses)
    return {"rung": rung.label, "target": rung.target, "size": rung.size(spec.lr.against),
            "losses": dict(sorted(losses.items())), "best_lr": vertex, "found_by": how,
            "best_grid_lr": min(losses, key=lambda lr: losses[lr]), "first": sorted(first)}


def centred(spec: LadderSpec, name: str, rung: Rung, below: list[dict]) -> list[float]:
    """A rung's first lrs: the factors around lr.start (the smallest swept rung), else around the best lr of the rung
    below, times (size ratio)^slope where the file fixes a slope."""
    if below:
        centre = below[-1]["best_lr"] * (rung.size(spec.lr.against) / below[-1]["size"]) ** (spec.lr.slope or 0.0)
    else:
        centre = spec.lr.start_of(name)
    return sorted({rounded_lr(centre * factor) for factor in spec.lr.factors})


def lr_sweeps(spec: LadderSpec, rungs: dict[str, list[Rung]], names: dict[str, str], out: Path,
              stage) -> dict[str, list[dict]] | None:
    """Each architecture's swept rungs (sweep_record), trained through `stage(runs, name)` (False: submitted, not
    waited for: then None). `names`: label -> the architecture as the file writes it. With lr.grid, every swept rung
    in one stage; else rung by rung, each widened where its best lr lies at an end, up to lr.widen lrs a side."""
    seed = spec.sweep_seed
    sweeps = {arch: [] for arch in rungs}

    def losses(rung: Rung, lrs: list[float]) -> dict[float, float]:
        return {lr: final_loss(run_dir(out, Run(rung, lr, seed))) for lr in lrs}

    if spec.lr.grid is not None:
        if not stage(sweep_runs(spec, rungs), "lr-sweep"):
            return None
        for arch, arch_rungs in rungs.items():
            grid = list(spec.lr.grid)
            sweeps[arch] = [sweep_record(spec, r, losses(r, grid), grid) for r in swept(spec, arch_rungs)]
        return sweeps
    for target in sorted({r.target for rs in rungs.values() for r in swept(spec, rs)}):
        at = {arch: next(r for r in swept(spec, rs) if r.target == target) for arch, rs in rungs.items()}
        first = {arch: centred(spec, names[arch], rung, sweeps[arch]) for arch, rung in at.items()}
        tried, new, label = {arch: list(lrs) for arch, lrs in first.items()}, first, next(iter(at.values())).label
        for round_ in range(2 * spec.lr.widen + 1):
            if not stage([Run(at[arch], lr, seed) for arch, lrs in new.items() for lr in lrs],
                         f"lr-{label}" + (f"-widened{round_}" if round_ else "")):
                return None
            new = {arch: [lr] for arch in at
                   if (lr := widening(losses(at[arch], tried[arch]), first[arch], spec.lr.widen)) is not None}
            for arch, lrs in new.items():
                tried[arch] += lrs
            if not new:
                break
        for arch, rung in at.items():
            sweeps[arch].append(sweep_record(spec, rung, losses(rung, tried[arch]), first[arch]))
    for arch, records in sweeps.items():
        edges = [s["rung"] for s in records if s["found_by"] in ("grid edge", "grid minimum")]
        if edges:
            print(f"lm compare ladder: warning: {arch}'s best lr lies at an end of its sweep at rung(s) "
                  f"{', '.join(edges)}" + (": widen lr.grid" if spec.lr.grid is not None else
                                            f", after widening by {spec.lr.widen} lr(s): raise lr.widen"),
                  file=sys.stderr)
    return sweeps


def lr_rules(spec: LadderSpec, sweeps: dict[str, list[dict]]) -> dict[str, dict]:
    """Per architecture: its sweeps, and the rule lr = c x size^s fitted over all of them (None where it cannot be:
    one swept size and no slope given)."""
    rules = {}
    for arch, records in sweeps.items():
        points = [(s["size"], s["best_lr"]) for s in records]
        fits = points and (spec.lr.slope is not None or len({size for size, _ in points}) >= 2)
        rules[arch] = {"rule": fit_rule(points, spec.lr.against, spec.lr.slope) if fits else None, "sweeps": records}
    return rules


def main_runs(spec: LadderSpec, rungs: dict[str, list[Rung]], rules: dict[str, dict]) -> list[Run]:
    """Every rung at every seed, each a fresh run (the sweep trains at its own seed): a swept size at its sweep's best
    lr (iso-FLOP: every budget of that size), any other at the rule's lr."""
    runs = []
    for arch, arch_rungs in rungs.items():
        best = {s["target"]: s["best_grid_lr"] for s in rules[arch]["sweeps"]}
        rule: LrRule | None = rules[arch]["rule"]
        for rung in arch_rungs:
            lr = best.get(rung.target) or rounded_lr(rule.lr(rung.size(spec.lr.against)))
            runs += [Run(rung, lr, seed) for seed in spec.seeds]
    return runs


def choose_runs(spec: LadderSpec, base, batch: int) -> tuple[dict[str, list[Rung]], list[Run]]:
    """The runs of `choose:`: each value of the option at its rung (matched params, tokens_per_param), every seed."""
    c = spec.choose
    sub = replace(spec, archs=tuple(c.candidates), rungs=(c.rung,), budgets=None, match="params", gpu=None,
                  choose=None)
    rungs = plan_rungs(sub, base, batch, c.candidates)
    return rungs, [Run(rs[0], c.lr, seed) for rs in rungs.values() for seed in c.seeds]


def welch_interval(first: list[float], second: list[float], level: float) -> tuple[float, float]:
    """The `level` interval of mean(first) - mean(second): Student's t at Welch-Satterthwaite's degrees of freedom."""
    from lm.compare.ladder_verdicts import t_quantile, welch_df

    terms = [(statistics.variance(x) / len(x), len(x) - 1) for x in (first, second)]
    gap = statistics.fmean(first) - statistics.fmean(second)
    var = sum(v for v, _ in terms)
    half = t_quantile((1 + level) / 2, welch_df(terms)) * math.sqrt(var) if var > 0 else 0.0
    return gap - half, gap + half


def choice(spec: LadderSpec, rungs: dict[str, list[Rung]], out: Path) -> dict:
    """The smallest value of the option shown to be at most `tolerance` above the reference: the upper end of the
    Welch interval of its mean loss minus the reference's lies below the tolerance (the reference itself when none
    is); every value's losses, mean, spread and interval, and whether the choice was made at the largest rung that
    uses it."""
    c, rows = spec.choose, []
    for value, rs in zip(c.values, rungs.values()):
        losses = [final_loss(run_dir(out, Run(rs[0], c.lr, seed))) for seed in c.seeds]
        finite = all(math.isfinite(x) for x in losses)
        rows.append({"value": value, "arch": rs[0].arch, "rung": rs[0].label, "losses": losses,
                     "mean": statistics.fmean(losses) if finite else math.inf,
                     "spread": max(losses) - min(losses) if finite else math.inf})
    reference = next(r for r in rows if r["value"] == c.reference)
    for row in rows:
        shown = row["value"] != c.reference and math.isfinite(row["mean"]) and math.isfinite(reference["mean"])
        row["interval"] = welch_interval(row["losses"], reference["losses"], spec.level) if shown else None
        row["within"] = row["value"] == c.reference or bool(shown and row["interval"][1] < c.tolerance)
    chosen = next(r["value"] for r in rows if r["within"])
    largest = max(spec.rungs)
    return {"arch": c.arch, "option": c.option, "reference": c.reference, "lr": c.lr, "tolerance": c.tolerance,
            "level": spec.level, "chosen": chosen, "rows": rows, "rung": c.rung, "largest_rung": largest,
            "confirmed": c.rung >= largest}


def run_dir(out: Path, run: Run) -> Path:
    return out / "runs" / run.name


def config_path(out: Path, run: Run) -> Path:
    return out / "configs" / f"{run.name}.yaml"


def ended(out: Path, run: Run) -> bool:
    """Trained to its last step (its final checkpoint), or diverged."""
    path = run_dir(out, run)
    return (path / "checkpoints" / f"step={run.rung.steps:08d}.ckpt").exists() or (path / DIVERGED).is_file()


def write_config(out: Path, run: Run, raw: dict, base, batch: int, data: str | None, data_seed: int | None) -> Path:
    config = run_config(raw, base, {"model": run.rung.model, "steps": run.rung.steps}, run.lr, run.seed, batch,
                        base.data.seq_len, run_dir(out, run).resolve())
    config["data"]["seed"] = data_seed  # None: the run's own seed orders its data
    config["trainer"]["val_every"] = run.rung.val_every
    if run.rung.micro_batch is not None:
        config["data"]["micro_batch"] = run.rung.micro_batch
        config["trainer"]["activation_checkpointing"] = run.rung.activation_checkpointing
    if data is not None:  # the ladder's data replaces the base's (a path, or a mixture's sources)
        config["data"].pop("sources", None)
        config["data"]["path"] = data
    path = config_path(out, run)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# {run.rung.arch} at rung {run.rung.label}: {run.rung.params:,} parameters, {run.rung.tokens:,} "
              f"tokens in {run.rung.steps} steps, lr {run.lr:g}, seed {run.seed}. Written by lm compare ladder.\n")
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    return path


def run_locally(jobs: dict, out: Path, workers: int, done=None) -> None:
    """One worker: the jobs run here, one after another. More: each in a process of its own, its output in
    OUT/logs/NAME.log."""
    logs = None
    if workers > 1:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        logs = {name: out / "logs" / f"{name}.log" for name in jobs}
    run_jobs(jobs, workers, max(1, (os.cpu_count() or 1) // workers), logs=logs, done=done)


def train_run(config: str) -> dict:
    """One local job: `lm train` on a ladder config (resuming a run an earlier call left unfinished); a run that
    diverges ends with the DIVERGED file, not an error (a high lr of the sweep may diverge). A run stopped on request
    (its checkpoint written) stops the ladder (lm.util.workers.Stopped); a rerun continues it."""
    start = time.perf_counter()
    from lm.training.config import parse_run_config
    from lm.training.stop_request import StoppedForRequeue
    from lm.training.train import train

    run, resume, resolved = parse_run_config(["--config", config])
    try:
        train(run, resume, resolved)
    except Diverged as err:
        (Path(run.run_dir) / DIVERGED).write_text(f"{err}\n")
    except StoppedForRequeue as stop:
        raise Stopped(f"stopped at step {stop.args[0]} with a checkpoint") from None
    return {"seconds": time.perf_counter() - start}


def mark_diverged(out: Path, runs: list[Run]) -> None:
    """A SLURM task that diverged exits 1 and says so in its log (lm.util.errors.Diverged's message from
    lm/training/train.py): mark its run as ended."""
    for run in runs:
        logs = sorted((run_dir(out, run) / "slurm").glob("job-*.err"))
        if any("were not finite (each was skipped)" in log.read_text() for log in logs):
            (run_dir(out, run) / DIVERGED).write_text("diverged (see its SLURM log)\n")


def wait_for(job: str, tasks: int) -> None:
    from lm.slurm import scheduler

    while any(scheduler.is_live(scheduler.job_info(f"{job}_{i}")) for i in range(tasks)):
        time.sleep(POLL_SECONDS)


def execute(runs: list[Run], out: Path, stage: str, where: str, workers: int, slurm: list[str], wait: bool) -> bool:
    """Train the runs not yet ended; True when all have (False: submitted, not waited for)."""
    pending = [run for run in runs if not ended(out, run)]
    if not pending:
        return True
    pending.sort(key=lambda r: -r.rung.flops_per_token * r.rung.tokens)  # costliest first: workers end together
    print(f"lm compare ladder: {stage}: {len(pending)} of {len(runs)} runs to train ({where})", file=sys.stderr)
    if where == "local":
        def done(name: str, result: dict) -> None:
            print(f"lm compare ladder: {name} done in {result['seconds']:.0f} s", file=sys.stderr)

        jobs = {run.name: partial(train_run, str(config_path(out, run))) for run in pending}
        if workers == 1:  # the runs train here and print their own progress
            run_locally(jobs, out, workers, done)
            return True
        by_name = {run.name: run for run in pending}
        logs = {name: out / "logs" / f"{name}.log" for name in by_name}
        with StageProgress(stage, logs, lambda name: ended(out, by_name[name])):
            run_locally(jobs, out, workers, done)
        return True
    from lm.slurm.submit import submit_from_args

    sweep = out / "slurm" / f"{stage}.yaml"
    sweep.parent.mkdir(parents=True, exist_ok=True)
    sweep.write_text(yaml.safe_dump({"runs": [{"config": str(config_path(out, r).resolve())} for r in pending]}))
    job = submit_from_args(["--array", str(sweep), "--job_dir", str(out / "slurm"), *slurm])
    if not wait:
        print(f"lm compare ladder: submitted {stage} as job {job}; run this command again when it has ended",
              file=sys.stderr)
        return False
    wait_for(job, len(pending))
    mark_diverged(out, pending)
    unfinished = [run.name for run in pending if not ended(out, run)]
    if unfinished:
        raise UserError(f"{len(unfinished)} run(s) of job {job} did not finish ({', '.join(unfinished)}; their logs: "
                        f"{out}/runs/NAME/slurm); run this command again to resume them")
    return True


def probe_arguments(command: list[str], checkpoint: str, out: str):
    """(the `lm eval` function, its parsed arguments) of a probe on one checkpoint."""
    from lm.util.commands import function_parser, load_command

    fn = load_command(f"eval {command[0]}")
    namespace = function_parser(fn, f"lm eval {command[0]}").parse_args([*command[1:], "--checkpoint", checkpoint,
                                                                          "--out", out])
    namespace.pop("config", None)
    return fn, namespace.as_dict()


def probe_run(command: list[str], checkpoint: str, out: str, marker: str) -> dict:
    """One probe: `lm eval COMMAND --checkpoint RUN --out OUT`, then its marker, so a rerun skips it."""
    start = time.perf_counter()
    fn, arguments = probe_arguments(command, checkpoint, out)
    fn(**arguments)
    Path(marker).write_text("done\n")
    return {"seconds": time.perf_counter() - start}


def check_probes(spec: LadderSpec) -> None:
    """Each probe names an `lm eval` command that takes --checkpoint and --out, with options it knows."""
    from lm.util.commands import COMMANDS

    for command in spec.probes:
        if f"eval {command[0]}" not in COMMANDS:
            raise UserError(f"{spec.path}: probe {command[0]!r} is no lm eval command")
        try:
            probe_arguments(list(command), "RUN", "OUT")
        except Exception as err:
            raise UserError(f"{spec.path}: probe {' '.join(command)}: {' '.join(str(err).split())}") from None


def run_probes(spec: LadderSpec, runs: list[Run], out: Path, workers: int) -> None:
    """Each probe on each run that did not diverge, into RUN/eval/COMMAND-ladderI, skipping those already done."""
    jobs = {}
    for run in runs:
        if (run_dir(out, run) / DIVERGED).is_file():
            continue
        for i, command in enumerate(spec.probes):
            folder = run_dir(out, run) / "eval" / f"{command[0]}-ladder{i}"  # where lm compare report looks
            marker = folder / "ladder-probe-done"
            if not marker.is_file():
                jobs[f"{run.name}-{command[0]}-{i}"] = partial(probe_run, list(command), str(run_dir(out, run)),
                                                               str(folder), str(marker))
    if jobs:
        commands = "; ".join(f"lm eval {' '.join(command)}" for command in spec.probes)
        print(f"lm compare ladder: probes: {len(jobs)} evaluation(s) of the finished runs ({commands}, each on a "
              f"run's checkpoint), {min(workers, len(jobs))} at a time; each says when it is done", file=sys.stderr)

        def done(name: str, result: dict) -> None:
            print(f"lm compare ladder: probe {name} done in {result['seconds']:.0f} s", file=sys.stderr)

        run_locally(jobs, out, workers, done)


def prepared(spec: LadderSpec, out: Path, seq_len: int) -> tuple[str | None, Path | None]:
    """(the data folder the runs read, a temporary folder holding it) when the ladder file asks for the bundled
    corpus, its validation held out in windows of the runs' `seq_len`: OUT/data where an earlier call prepared it,
    else prepared into a temporary folder, which moves to OUT/data once the plan is accepted (a refused plan, or a dry
    run, writes nothing)."""
    if not spec.prepare:
        return None, None
    if (out / "data" / "manifest.json").is_file():
        return str((out / "data").resolve()), None
    from lm.data_prep.prepare import BUNDLED_CORPUS, prepare

    temporary = Path(tempfile.mkdtemp(prefix="lm-ladder-data-"))
    print(f"lm compare ladder: preparing the bundled corpus at a {spec.prepare['vocab_size']}-token BPE, to count "
          f"its tokens against the plan", file=sys.stderr)
    prepare([str(BUNDLED_CORPUS)], str(temporary / "data"), vocab_size=int(spec.prepare["vocab_size"]),
            seq_len=seq_len, progress=False)
    return str(temporary / "data"), temporary


def checked_plan(spec: LadderSpec, base, batch: int, rungs: dict[str, list[Rung]], corpus: Corpus) -> None:
    """Before anything runs: the data each run reads, for every value a choice may take."""
    check_data(spec, rungs, corpus)
    if spec.choose:
        check_data(spec, choose_runs(spec, base, batch)[0], corpus)
        for value in spec.choose.values:
            check_data(spec, plan_rungs(spec, base, batch, [resolved(n, spec.choose, value) for n in spec.archs]),
                       corpus)


def ladder(file: str, out: str = "runs/ladder", where: Literal["local", "slurm"] = "local", workers: int = 2,
           slurm: list[str] | None = None, wait: bool = True, dry_run: bool = False) -> Path:
    """Architectures compared at matched compute by their runs, and by scaling curves judged on held-out rungs.

    Args:
        file: The ladder file (configs/ladder/cpu.yaml: 4 architectures on 2 CPU cores, docs/ladder.md).
        out: Where configs/, runs/, logs/, slurm/, data/, ladder.json and report/ go; a rerun skips what is done.
        where: local: worker processes here; slurm: one array job per stage (lm slurm submit --array).
        workers: Local jobs at once (each with cpu_count / workers threads).
        slurm: Further `lm slurm submit` options for the array jobs, e.g. ["--time=24:00:00", "--mem=8G"].
        wait: With --where slurm: wait for each stage's job, then go on; false: submit one stage and return.
        dry_run: Print the planned rungs, runs, data and (with the file's gpu section) GPU-hours; write nothing.
    """
    from lm.compare.ladder_report import write_report

    spec = load_ladder(file)
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    raw, base = load_base(spec.base)
    if spec.prepare:
        from lm.data_prep.tokenizer import check_vocab_size

        check_vocab_size(int(spec.prepare["vocab_size"]))
        if spec.prepare["vocab_size"] != base.model.vocab_size:
            raise UserError(f"{spec.path}: prepare.vocab_size {spec.prepare['vocab_size']} differs from the base "
                            f"config's model.vocab_size {base.model.vocab_size}")
    batch = sequences_per_step(base, None)
    rungs = plan_rungs(spec, base, batch)
    check_probes(spec)
    check_rule_can_fit(spec, rungs)  # both before preparing the corpus
    data, temporary = prepared(spec, out_dir, base.data.seq_len)
    try:
        corpus = corpus_of(data, raw, base.data.seq_len)
        if spec.prepare:
            corpus = replace(corpus, where=f"the bundled corpus at a {spec.prepare['vocab_size']}-token BPE (OUT/data)")
        checked_plan(spec, base, batch, rungs, corpus)
        print(plan_table(spec, rungs, corpus), end="")
        if spec.gpu:
            print(gpu_hours_table(spec, rungs), end="")
        if dry_run:
            return out_dir
        check_code(sorted((out_dir / "runs").glob("*")), spec.allow_mixed_code, str(spec.path), training=False)
        if where == "slurm":
            from lm.slurm import scheduler

            scheduler.require("sbatch")
        out_dir.mkdir(parents=True, exist_ok=True)
        if temporary is not None:
            shutil.move(data, out_dir / "data")
            data = str((out_dir / "data").resolve())
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)

    def stage(runs: list[Run], name: str) -> bool:
        if any(not ended(out_dir, run) for run in runs):  # this code trains them: it must be the other runs' code
            check_code(sorted((out_dir / "runs").glob("*")), spec.allow_mixed_code, str(spec.path), training=True)
        for run in runs:
            write_config(out_dir, run, raw, base, batch, data, spec.data_seed)
        return execute(runs, out_dir, name, where, workers, slurm or [], wait)

    record = {"file": str(spec.path), "corpus_tokens": corpus.tokens}
    chosen = None
    if spec.choose:
        candidates, runs = choose_runs(spec, base, batch)
        if not stage(runs, "choose"):
            return out_dir
        chosen = choice(spec, candidates, out_dir)
        print(f"lm compare ladder: choose: {spec.choose.option} {chosen['chosen']} for {spec.choose.arch} (the "
              f"smallest shown within {spec.choose.tolerance:g} nats of {spec.choose.option} {spec.choose.reference})",
              file=sys.stderr)
        rungs = plan_rungs(spec, base, batch, [resolved(n, spec.choose, chosen["chosen"]) for n in spec.archs])
        record["choice"] = chosen
    names = dict(zip(rungs, spec.archs))  # label -> the architecture as the file writes it
    write_json(out_dir / "ladder.json", {**record, "rungs": {a: [asdict(r) for r in rs] for a, rs in rungs.items()}},
               indent=1)
    sweeps = lr_sweeps(spec, rungs, names, out_dir, stage)
    if sweeps is None:
        return out_dir
    rules = lr_rules(spec, sweeps)
    runs = main_runs(spec, rungs, rules)
    if not stage(runs, "rungs"):
        return out_dir
    run_probes(spec, runs, out_dir, workers)
    return write_report(spec, rules, runs, out_dir, lambda run: final_loss(run_dir(out_dir, run)),
                        partial(run_dir, out_dir), base.data.seq_len, chosen=chosen, corpus=corpus)

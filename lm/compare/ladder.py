"""`lm compare ladder LADDER.yaml --out DIR`: architectures compared by fitted scaling curves, not by single
runs. The ladder file (lm/compare/ladder_config.py, configs/ladder/) names the architectures, the rungs (sizes matched
by `lm compare plan`), the budget of each rung (tokens per parameter, or total FLOPs for iso-FLOP curves), the lr
grid swept on the smallest rungs, the seeds and the probes.

It runs in stages, each skipping what an earlier call finished, so a rerun resumes:
1. the lr sweep: every lr of the grid on the smallest rungs, at the first seed;
2. every rung at every seed: the swept rungs at their best grid lr, the others at the lr the rule fitted to the swept
   rungs' best lrs gives (lm/compare/lr_transfer.py);
3. the probes (`lm eval` commands) on each finished run of stage 2;
4. the fits and the report (lm/compare/ladder_report.py): L(C) = E + A C^-alpha per architecture with bootstrap
   intervals, the prediction at the target compute, the crossovers, and L(N, D) where the budgets allow.

Each run is an ordinary `lm train` run (OUT/configs/NAME.yaml, OUT/runs/NAME). `--where local` trains them in worker
processes here; `--where slurm` submits each stage's unfinished runs as one array job (`lm slurm submit --array`:
requeued on preemption, resumed from its checkpoint) and, with `--wait true`, waits for it before going on; with
`--wait false` it returns after submitting, and the same command, run again when the job has ended, goes on.
"""

import math
import os
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Literal

import yaml

from lm.compare.ladder_config import LadderSpec, load_ladder
from lm.compare.ladder_plan import (
    Run,
    Rung,
    check_rule_can_fit,
    gpu_hours_table,
    plan_rungs,
    plan_table,
    rounded_lr,
    sweep_runs,
    swept,
)
from lm.compare.lr_transfer import LrRule, best_lr, fit_rule
from lm.compare.plan import load_base, run_config, sequences_per_step
from lm.errors import Diverged, UserError
from lm.output import write_json
from lm.workers import run_jobs

POLL_SECONDS = 2.0
DIVERGED = "diverged"  # a file in a run directory whose training diverged: it ended, with no final loss


def final_loss(run_dir: Path) -> float:
    """The last validation loss of a finished run (inf for a diverged one)."""
    from lm.compare.run_results import read_run

    if (run_dir / DIVERGED).is_file():
        return math.inf
    loss = read_run(str(run_dir)).val_loss
    return math.inf if loss is None or not math.isfinite(loss) else loss


def lr_rules(spec: LadderSpec, rungs: dict[str, list[Rung]], out: Path) -> dict[str, dict]:
    """Per architecture: each swept rung's losses by lr, its best lr (vertex) and best grid lr, and the rule."""
    rules = {}
    for arch, arch_rungs in rungs.items():
        points, sweeps = [], []
        for rung in swept(spec, arch_rungs):
            losses = {lr: final_loss(run_dir(out, Run(rung, lr, spec.seeds[0]))) for lr in spec.lr.grid}
            vertex, how = best_lr(losses)
            grid_best = min(losses, key=lambda lr: losses[lr])
            points.append((rung.size(spec.lr.against), vertex))
            sweeps.append({"rung": rung.label, "size": rung.size(spec.lr.against), "losses": losses,
                           "best_lr": vertex, "found_by": how, "best_grid_lr": grid_best})
        carried = len(arch_rungs) > len(sweeps)  # a rung left to carry the lr up to
        rule = fit_rule(points, spec.lr.against, spec.lr.slope) if carried else None
        rules[arch] = {"rule": rule, "sweeps": sweeps}
        edges = [s["rung"] for s in sweeps if s["found_by"] in ("grid edge", "grid minimum")]
        if edges:
            print(f"lm compare ladder: warning: {arch}'s best lr lies at an end of the grid at rung(s) "
                  f"{', '.join(edges)}; the rule carries it up unbracketed: widen lr.grid", file=sys.stderr)
    return rules


def main_runs(spec: LadderSpec, rungs: dict[str, list[Rung]], rules: dict[str, dict]) -> list[Run]:
    """Every rung at every seed: a swept rung at its best grid lr, any other at the rule's lr."""
    runs = []
    for arch, arch_rungs in rungs.items():
        best_grid = {s["rung"]: s["best_grid_lr"] for s in rules[arch]["sweeps"]}
        rule: LrRule | None = rules[arch]["rule"]
        for rung in arch_rungs:
            lr = best_grid.get(rung.label) or rounded_lr(rule.lr(rung.size(spec.lr.against)))
            runs += [Run(rung, lr, seed) for seed in spec.seeds]
    return runs


def run_dir(out: Path, run: Run) -> Path:
    return out / "runs" / run.name


def config_path(out: Path, run: Run) -> Path:
    return out / "configs" / f"{run.name}.yaml"


def ended(out: Path, run: Run) -> bool:
    """Trained to its last step (its final checkpoint), or diverged."""
    path = run_dir(out, run)
    return (path / "checkpoints" / f"step={run.rung.steps:08d}.ckpt").exists() or (path / DIVERGED).is_file()


def write_config(out: Path, run: Run, raw: dict, base, batch: int, data: str | None) -> Path:
    config = run_config(raw, base, {"model": run.rung.model, "steps": run.rung.steps}, run.lr, run.seed, batch,
                        base.data.seq_len, run_dir(out, run).resolve())
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
    diverges ends with the DIVERGED file, not an error (a high lr of the sweep may diverge)."""
    start = time.perf_counter()
    from lm.training.config import parse_run_config
    from lm.training.train import train

    run, resume, resolved = parse_run_config(["--config", config])
    try:
        train(run, resume, resolved)
    except Diverged as err:
        (Path(run.run_dir) / DIVERGED).write_text(f"{err}\n")
    return {"seconds": time.perf_counter() - start}


def mark_diverged(out: Path, runs: list[Run]) -> None:
    """A SLURM task that diverged exits 1 and says so in its log (lm.errors.Diverged's message from
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

        run_locally({run.name: partial(train_run, str(config_path(out, run))) for run in pending}, out, workers, done)
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
    from lm.commands import function_parser, load_command

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
    from lm.commands import COMMANDS

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
        print(f"lm compare ladder: {len(jobs)} probe(s) to run", file=sys.stderr)
        run_locally(jobs, out, workers)


def prepared(spec: LadderSpec, out: Path) -> str | None:
    """The bundled corpus prepared into OUT/data when the ladder file asks for it (a rerun reuses it)."""
    if not spec.prepare:
        return None
    from lm.data_prep.prepare import BUNDLED_CORPUS, prepare

    prepare([str(BUNDLED_CORPUS)], str(out / "data"), vocab_size=int(spec.prepare["vocab_size"]), progress=False)
    return str((out / "data").resolve())


def ladder(file: str, out: str = "runs/ladder", where: Literal["local", "slurm"] = "local", workers: int = 2,
           slurm: list[str] | None = None, wait: bool = True, dry_run: bool = False) -> Path:
    """Architectures compared by fitted scaling curves: the ladder file's runs, its lr rule, fits and report.

    Args:
        file: The ladder file (configs/ladder/cpu.yaml: 5 architectures on 2 CPU cores in about 2 hours).
        out: Where configs/, runs/, logs/, slurm/, ladder.json and report/ go; a rerun skips what is done.
        where: local: worker processes here; slurm: one array job per stage (lm slurm submit --array).
        workers: Local jobs at once (each with cpu_count / workers threads).
        slurm: Further `lm slurm submit` options for the array jobs, e.g. ["--time=24:00:00", "--mem=8G"].
        wait: With --where slurm: wait for each stage's job, then go on; false: submit one stage and return.
        dry_run: Print the planned rungs, runs and (with the file's gpu section) GPU-hours; write nothing.
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
    check_rule_can_fit(spec, rungs)
    stage1 = sweep_runs(spec, rungs)
    print(plan_table(spec, rungs, len(stage1)), end="")
    if spec.gpu:
        print(gpu_hours_table(spec, rungs), end="")
    if dry_run:
        return out_dir
    if where == "slurm":
        from lm.slurm import scheduler

        scheduler.require("sbatch")
    out_dir.mkdir(parents=True, exist_ok=True)
    data = prepared(spec, out_dir)
    write_json(out_dir / "ladder.json", {"file": str(spec.path), "rungs": {a: [asdict(r) for r in rs]
                                                                          for a, rs in rungs.items()}}, indent=1)
    for run in stage1:
        write_config(out_dir, run, raw, base, batch, data)
    if not execute(stage1, out_dir, "lr-sweep", where, workers, slurm or [], wait):
        return out_dir
    rules = lr_rules(spec, rungs, out_dir)
    stage2 = main_runs(spec, rungs, rules)
    for run in stage2:
        write_config(out_dir, run, raw, base, batch, data)
    if not execute(stage2, out_dir, "rungs", where, workers, slurm or [], wait):
        return out_dir
    run_probes(spec, stage2, out_dir, workers)
    return write_report(spec, rules, stage2, out_dir, lambda run: final_loss(run_dir(out_dir, run)),
                        partial(run_dir, out_dir), base.data.seq_len)

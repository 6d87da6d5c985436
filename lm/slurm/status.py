"""`lm slurm status RUN_DIR`: the run's SLURM jobs (state, restarts, elapsed time, nodes), its last logged step
and its newest checkpoint."""

import csv
from pathlib import Path

from lm.slurm import scheduler
from lm.training.checkpoint import newest_checkpoint
from lm.util.errors import UserError


def last_logged_step(run_dir: Path) -> int | None:
    """The highest step in the run's CSV logs (every launch writes its own logs/version_N)."""
    steps = []
    for path in Path(run_dir).glob("logs/version_*/metrics.csv"):
        with open(path) as f:
            steps += [int(row["step"]) for row in csv.DictReader(f) if row.get("step")]
    return max(steps, default=None)


def slurm_status(run_dir: str) -> str:
    """Show a run's SLURM jobs, restarts, last logged step and newest checkpoint.

    Args:
        run_dir: The run directory (as submitted with `lm slurm submit`).
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise UserError(f"run directory {run_dir} not found")
    jobs = scheduler.recorded_jobs(run)
    if not jobs:
        raise UserError(f"{run_dir} has no SLURM jobs on record ({run / 'slurm' / scheduler.JOBS_FILE})")
    lines = [f"run {run}"]
    for job in jobs:
        info = scheduler.job_info(job["job"])
        if info is None:
            lines.append(f"  job {job['job']:<10} {job['kind']:<5} ended (no longer known to SLURM); "
                         f"submitted {job['submitted']}")
            continue
        lines.append(f"  job {job['job']:<10} {job['kind']:<5} {info.get('JobState', '?'):<10} "
                     f"restarts {info.get('Restarts', '?')}  elapsed {info.get('RunTime', '?')}  "
                     f"exit {info.get('ExitCode', '?')}  nodes {info.get('NodeList', '?')}")
    step = last_logged_step(run)
    newest = newest_checkpoint(run / "checkpoints", warn=False)
    lines.append(f"  last logged step {step if step is not None else '-'}; newest checkpoint "
                 f"{newest.name if newest else '-'}")
    text = "\n".join(lines)
    print(text)
    return text

"""The few SLURM commands `lm slurm` needs: sbatch to submit, scontrol to ask about a job. No accounting database
is assumed (clusters without slurmdbd have no sacct), so a job SLURM has forgotten counts as finished."""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from lm.util.errors import UserError

# States of a job that has not ended (or will run again); anything else, or a forgotten job, has ended.
LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
               "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "SPECIAL_EXIT"}
JOBS_FILE = "jobs.jsonl"  # in RUN_DIR/slurm: one line per job submitted for the run


def require(command: str) -> str:
    path = shutil.which(command)
    if path is None:
        raise UserError(f"{command} not found: run this on a SLURM login node (or start slurm/local_cluster.sh "
                        f"and export SLURM_CONF as it says)")
    return path


def sbatch(script: Path, dependency: str | None = None) -> str:
    """Submit `script`, to start once `dependency` holds ("afterok:ID"); the job id (of the array, for an array
    job)."""
    after = [f"--dependency={dependency}"] if dependency else []
    result = subprocess.run([require("sbatch"), "--parsable", *after, str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"sbatch refused {script}: {' '.join(result.stderr.split())}")
    return result.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict[str, str] | None:
    """`scontrol show job` as a dict (JobState, Restarts, RunTime, NodeList, ExitCode, ...); None if SLURM no
    longer knows the job."""
    result = subprocess.run([require("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        return None
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout.splitlines()[0]))


def is_live(info: dict[str, str] | None) -> bool:
    return info is not None and info.get("JobState") in LIVE_STATES


def recorded_jobs(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "slurm" / JOBS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record_job(run_dir: Path, job_id: str, kind: str, script: Path) -> None:
    path = Path(run_dir) / "slurm" / JOBS_FILE
    with open(path, "a") as f:
        f.write(json.dumps({"job": job_id, "kind": kind, "script": str(script),
                            "submitted": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")

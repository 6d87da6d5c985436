"""What made a run (docs/design.md, "Run records"): for every launch of `lm train` in a run directory, the lm code
(its commit and whether lm/ differs from it), the software, the machine, the threads, the data's manifests and the
step it started from, in RUN/run_record.json. A reported number can then be traced to what produced it, and `lm
compare ladder` can refuse to mix runs of different code. Written by rank 0 before training starts; read without
Lightning."""

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from lm.training.checkpoint import STEP_NAME
from lm.util.output import write_json

RECORD = "run_record.json"
PACKAGE = Path(__file__).resolve().parents[1]  # lm/


def _git(*args: str) -> str | None:
    """git's output, run in the folder holding lm/ (paths relative to it), or None (no git, lm/ in no checkout: an
    installed wheel, or git failed)."""
    try:
        done = subprocess.run(["git", "-C", str(PACKAGE.parent), *args], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode(errors="replace") if done.returncode == 0 else None


def code_identity() -> dict:
    """The lm code this process runs. In a git checkout: its commit, and `dirty` when lm/ differs from it (tracked
    changes or new files), with a sha256 of that difference so that two runs of one uncommitted change still match.
    Installed from a wheel: its version alone (`commit` None)."""
    from lm import __version__

    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != PACKAGE.parent:
        return {"lm_version": __version__, "commit": None, "dirty": None, "diff_sha256": None}
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    diff = _git("diff", "HEAD", "--binary", "--", "lm")
    new = _git("ls-files", "--others", "--exclude-standard", "--", "lm")
    if commit is None or diff is None or new is None:  # git failed: whether lm/ differs is not known
        return {"lm_version": __version__, "commit": commit, "dirty": None, "diff_sha256": None}
    new = new.split()
    digest = hashlib.sha256(diff.encode())
    for name in sorted(new):
        digest.update(name.encode() + b"\0" + (PACKAGE.parent / name).read_bytes())
    dirty = bool(diff or new)
    return {"lm_version": __version__, "commit": commit, "dirty": dirty,
            "diff_sha256": digest.hexdigest() if dirty else None}


def code_key(record: dict) -> str:
    """One string per distinct code: the commit (with its difference's hash when dirty), or the wheel's version."""
    code = record.get("code") or {}
    if code.get("commit"):
        return code["commit"][:12] + (f"+dirty:{code['diff_sha256'][:12]}" if code.get("dirty") else "")
    return f"lm {code.get('lm_version', '?')} (no commit)"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(accelerator: str) -> dict:
    """The device the run computes on, and the thread settings that change a CPU run's float sums."""
    import torch

    gpu = torch.cuda.get_device_name() if accelerator != "cpu" and torch.cuda.is_available() else None
    return {"device": gpu or _cpu_name(), "accelerator": "cuda" if gpu else "cpu", "host": platform.node(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "env_threads": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}}


def software() -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": _version("numpy"),
            "lightning": _version("lightning"), "deepspeed": _version("deepspeed"), "platform": platform.platform()}


def data_identity(paths: list[str]) -> list[dict]:
    """Each data source's manifest.json sha256 (its shards' own checksums are inside it)."""
    found = []
    for path in paths:
        manifest = Path(path) / "manifest.json"
        found.append({"path": str(Path(path).resolve()),
                      "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest()})
    return found


def resumed_step(checkpoint: Path | None) -> int:
    match = STEP_NAME.match(checkpoint.name) if checkpoint is not None else None
    return int(match.group(1)) if match else 0


def launch_entry(accelerator: str, data_paths: list[str], checkpoint: Path | None, world: int,
                 note: dict | None = None) -> dict:
    """One launch: when, from which step (0: a fresh start) and checkpoint, on how many processes, with what."""
    entry = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step": resumed_step(checkpoint),
             "checkpoint": str(checkpoint) if checkpoint is not None else None, "processes": world,
             "argv": sys.argv[1:], "code": code_identity(), "software": software(), "machine": machine(accelerator),
             "data": data_identity(data_paths)}
    return {**entry, **(note or {})}


def read_record(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("launches") else None


def record_launch(run_dir: str | Path, entry: dict) -> dict:
    """Adds a launch to RUN/run_record.json (written whole or not at all). The record's top level repeats the first
    launch's code, software, machine and data, which a rerun must match to give the same numbers."""
    record = read_record(run_dir) or {"launches": []}
    record["launches"].append(entry)
    first = record["launches"][0]
    record.update({key: first[key] for key in ("code", "software", "machine", "data")})
    record["mixed"] = sorted(key for key in ("code", "software", "machine", "data")
                             if any(_comparable(launch, key) != _comparable(first, key)
                                    for launch in record["launches"][1:]))
    write_json(Path(run_dir) / RECORD, record)
    return record


def _comparable(launch: dict, key: str):
    """What must agree between a run's launches for the run to be one computation (the host's name need not)."""
    value = launch[key]
    if key == "machine":
        return {k: v for k, v in value.items() if k != "host"}
    if key == "data":
        return [d["manifest_sha256"] for d in value]
    return value

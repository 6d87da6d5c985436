"""What each run of a ladder ran on, from its RUN/run_record.json (lm.training.run_record): the lm code, torch, the
device, the threads, the data and its resumes. A ladder's runs are one measurement only if they ran the same code:
`check_code` refuses, before anything trains and again before the report, to mix runs whose records name different
code, unless the ladder file sets allow_mixed_code."""

from pathlib import Path

from lm.util.errors import UserError

UNRECORDED = "no record (lm before run records)"


def run_code(record: dict | None) -> list[str]:
    """The code of each launch of a run (one entry per distinct code), or UNRECORDED."""
    from lm.training.run_record import code_key

    if record is None:
        return [UNRECORDED]
    return list(dict.fromkeys(code_key(launch) for launch in record["launches"]))


def check_code(run_dirs: list[Path], allow_mixed: bool, where: str, training: bool) -> None:
    """One line (exit 2) where the runs in `run_dirs` that have started, and, when `training`, the code of this
    process (which trains the rest), are not all one code; nothing when the ladder allows mixed code."""
    from lm.training.run_record import code_identity, code_key, read_record

    codes: dict[str, list[str]] = {}
    for run in run_dirs:
        if run.is_dir():
            for code in run_code(read_record(run)):
                codes.setdefault(code, []).append(run.name)
    if training:
        codes.setdefault(code_key({"code": code_identity()}), []).append("(the runs this call trains)")
    if len(codes) > 1 and not allow_mixed:
        parts = [f"{code}: {len(runs)} run(s), e.g. {runs[0]}" for code, runs in codes.items()]
        raise UserError(f"{where}: its runs would mix lm code ({'; '.join(parts)}): rerun into a new --out, or set "
                        f"allow_mixed_code: true in the ladder file to compare them anyway")


def describe(record: dict | None) -> dict:
    """The columns the report's Runs table shows of a run's record."""
    if record is None:
        return {"code": UNRECORDED, "torch": "", "device": "", "threads": "", "resumed at": ""}
    machine = record["machine"]
    resumes = [str(launch["step"]) for launch in record["launches"][1:]]
    return {"code": ", ".join(run_code(record)), "torch": record["software"]["torch"],
            "device": machine["device"], "threads": str(machine["torch_threads"]),
            "resumed at": ", ".join(resumes) or "never"}


def summary(records: dict[str, dict | None]) -> list[str]:
    """One line per column of `describe` that the runs do not all share, or that they all share."""
    rows = {name: describe(record) for name, record in records.items()}
    lines = []
    for column in ("code", "torch", "device", "threads"):
        values = sorted({row[column] for row in rows.values()})
        lines.append(f"- {column}: {values[0]} (every run)" if len(values) == 1 else
                     f"- {column}: {len(values)} different ({', '.join(values)}): see the Runs table")
    resumed = [name for name, row in rows.items() if row["resumed at"] not in ("never", "")]
    lines.append(f"- resumed: {len(resumed)} of {len(rows)} runs (the step of each resume is in the Runs table)")
    return lines

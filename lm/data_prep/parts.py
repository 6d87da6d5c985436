"""`lm prepare` as a SLURM array: a plan, one part per task, a merge that writes the same bytes as one process.

    lm prepare ... --tasks N              the plan: tokenizer into OUT, OUT/.parts/plan.json (each task's files)
    lm prepare ... --tasks N --task I     task I tokenizes its contiguous share of the files into OUT/.parts/0000I/
    lm prepare ... --tasks N --merge true replays the parts in order through the same shard writer, then removes them

A part holds its documents' tokens (separators included, as the shards hold them) and, per document, its length, its
replaced bytes and its group (the recipe source it goes to). Tasks and the merge check their inputs and settings
against the plan by paths and sizes (the plan step hashed every file for the fingerprint; N tasks need not again),
and a part names the plan it belongs to.
"""

import hashlib
import json
import os
import shutil
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from lm.util.errors import UserError
from lm.util.output import write_json

from .shards import DTYPES

PARTS = ".parts"
PLAN = "plan.json"
PART = "part.json"
FIELDS = 3  # per document: tokens, replaced bytes, group index


def shares(sizes: list[int], tasks: int) -> list[list[int]]:
    """Contiguous [start, end) ranges of the files, one per task, balanced by bytes: each file goes to the task whose
    slice of the total holds the file's middle byte (a task may get none: more tasks than files, or one huge file)."""
    total = max(sum(sizes), 1)
    owner, before = [], 0
    for size in sizes:
        owner.append(min(tasks - 1, (2 * before + size) * tasks // (2 * total)))
        before += size
    return [[bisect_left(owner, t), bisect_right(owner, t)] for t in range(tasks)]  # owners never decrease


def plan_id(plan: dict) -> str:
    """What a part records to say which plan it belongs to."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def parts_dir(out: Path) -> Path:
    return Path(out) / PARTS


def write_plan(out: Path, plan: dict) -> None:
    """A fresh plan, replacing any earlier one and its parts (they belong to other inputs or settings)."""
    shutil.rmtree(parts_dir(out), ignore_errors=True)
    parts_dir(out).mkdir(parents=True)
    write_json(parts_dir(out) / PLAN, plan)


def load_plan(out: Path, check: dict, tasks: int) -> dict:
    """The plan in OUT, which must be for these inputs and settings; else one line saying to plan first."""
    path = parts_dir(out) / PLAN
    again = f"run `lm prepare ... --tasks {tasks}` (without --task or --merge) first"
    if not path.is_file():
        raise UserError(f"no plan in {parts_dir(out)}: {again}")
    try:
        plan = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"bad plan {path}: {e}; {again}") from None
    if not isinstance(plan, dict) or plan.get("check") != check:
        raise UserError(f"{path} is a plan for other inputs or settings (or --tasks): {again}")
    return plan


def part_path(out: Path, task: int) -> Path:
    return parts_dir(out) / f"{task:05d}"


def write_part(out: Path, plan: dict, task: int, docs: Iterable[tuple[np.ndarray, int, str | None]]) -> dict:
    """Task `task`'s documents (ids, replaced bytes, group) into its part, renamed into place when complete."""
    final = part_path(out, task)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    dtype, groups = DTYPES[plan["dtype"]], {g: i for i, g in enumerate(plan["groups"])}
    table, tokens = [], 0
    with open(tmp / "tokens.bin", "wb", buffering=1 << 20) as f:
        for ids, replaced, group in docs:
            f.write(ids.astype(dtype, copy=False).tobytes())
            table.append((len(ids), replaced, groups[group]))
            tokens += len(ids)
        f.flush()
        os.fsync(f.fileno())  # on disk before the name says the part is complete (the merge may run elsewhere)
    np.array(table, dtype="<i8").reshape(-1, FIELDS).tofile(tmp / "documents.bin")
    meta = {"plan": plan_id(plan), "task": task, "documents": len(table), "tokens": tokens}
    write_json(tmp / PART, meta)
    shutil.rmtree(final, ignore_errors=True)  # a rerun of the task replaces its part
    os.replace(tmp, final)
    return meta


def check_parts(out: Path, plan: dict) -> None:
    """Every task's part, complete and of this plan, before anything is written; else one line naming what is not."""
    missing, foreign = [], []
    for task in range(plan["tasks"]):
        try:
            meta = json.loads((part_path(out, task) / PART).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            missing.append(task)
            continue
        if not part_ok(part_path(out, task), meta, plan, task):
            foreign.append(task)
    if missing:
        raise UserError(f"missing parts for tasks {listed(missing)} of {plan['tasks']} in {parts_dir(out)}: run those "
                        f"tasks (--task I) before --merge")
    if foreign:
        raise UserError(f"parts for tasks {listed(foreign)} in {parts_dir(out)} are damaged or from another plan: "
                        "run those tasks again (--task I) before --merge")


def part_ok(path: Path, meta, plan: dict, task: int) -> bool:
    """The part names this plan and task, and its files have the sizes it says."""
    if not isinstance(meta, dict) or meta.get("plan") != plan_id(plan) or meta.get("task") != task:
        return False
    tokens, documents = meta.get("tokens"), meta.get("documents")
    if not isinstance(tokens, int) or not isinstance(documents, int):
        return False
    sizes = {"tokens.bin": tokens * DTYPES[plan["dtype"]].itemsize, "documents.bin": documents * 8 * FIELDS}
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in sizes.items())


def listed(tasks: list[int]) -> str:
    return ", ".join(map(str, tasks[:10])) + (f" and {len(tasks) - 10} more" if len(tasks) > 10 else "")


def replay(out: Path, plan: dict) -> Iterator[tuple[np.ndarray, int, str | None]]:
    """Every part's documents (ids, replaced bytes, group), tasks in order: the one-process stream again."""
    dtype = DTYPES[plan["dtype"]]
    for task in range(plan["tasks"]):
        path = part_path(out, task)
        table = np.fromfile(path / "documents.bin", dtype="<i8").reshape(-1, FIELDS)
        if not len(table):
            continue
        tokens = np.memmap(path / "tokens.bin", dtype=dtype, mode="r")
        ends = np.cumsum(table[:, 0])
        for (length, replaced, group), end in zip(table.tolist(), ends.tolist()):
            yield tokens[end - length:end], replaced, plan["groups"][group]


def remove_parts(out: Path, plan: dict) -> None:
    """The parts, once the manifests are written (the plan stays: a rerun of the merge then finds the dataset done)."""
    for task in range(plan["tasks"]):
        shutil.rmtree(part_path(out, task), ignore_errors=True)

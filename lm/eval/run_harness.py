"""`lm eval harness`: lm-eval tasks or a suite (eval/suites/NAME.yaml) on a checkpoint; results.json and
results.md in the run directory.

Real task names stay as they are, so a machine with the hub or a datasets cache runs them unchanged. Offline, each
task's data is loaded before anything is evaluated, and a missing one ends with an error that names it.
"""

import json
import sys
from pathlib import Path

import yaml

from lm.util.errors import UserError
from lm.util.resources import shipped

SUITES = shipped("eval/suites")
TASKS = shipped("eval/tasks")  # lm's own task YAMLs (the Based in-context recall tasks); always included


def load_suite(suite: str) -> dict:
    """A suite by name (eval/suites/NAME.yaml) or path: {tasks: [{task, metric}], num_fewshot, metadata}."""
    path = Path(suite) if suite.endswith((".yaml", ".yml")) else SUITES / f"{suite}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in SUITES.glob("*.yaml")))
        raise UserError(f"suite {suite} not found (one of {names}, or a YAML path)")
    return yaml.safe_load(path.read_text())


def load_tasks(names: list[str], task_manager) -> None:
    """Every task must exist and its data must load (lm-eval caches what it loads for the run itself)."""
    from lm_eval.tasks import get_task_dict

    unknown = [n for n in names if n not in task_manager.all_tasks]
    if unknown:
        raise UserError(f"unknown lm-eval task(s): {', '.join(unknown)} (see `lm_eval ls tasks`)")
    for name in names:
        try:
            get_task_dict([name], task_manager)
        except Exception as err:  # datasets raises many kinds when offline or when a file is missing
            first = " ".join(str(err).split())[:300] or type(err).__name__
            raise UserError(f"task {name}: its data could not be loaded ({first}); offline, it must already be "
                            f"in the datasets cache (HF_DATASETS_CACHE)") from None


def loaded_task_manager(names: list[str], include_paths: list[str], metadata: dict | None):
    """lm-eval's TaskManager, with every task's data loaded (load_tasks). It indexes the given folders alone when
    that is enough, else lm-eval's own tasks too: indexing lm-eval's thousands of task YAMLs takes about 10 s,
    which a run of local tasks (lm's Based tasks, exported probes) need not pay."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=include_paths, include_defaults=False, metadata=metadata)
    if all(name in local.all_tasks for name in names):
        try:
            load_tasks(names, local)
            return local
        except UserError:  # e.g. a local group of lm-eval's tasks: try again with them indexed
            pass
    manager = TaskManager(include_path=include_paths, metadata=metadata)
    load_tasks(names, manager)
    return manager


def markdown_table(results: dict, metrics: dict[str, str]) -> str:
    lines = ["| task | metric | value | stderr |", "| --- | --- | --- | --- |"]
    for task, values in results.items():
        for key, value in values.items():
            name, _, flt = key.partition(",")
            if not flt or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            if metrics.get(task) not in (None, name):
                continue
            stderr = values.get(f"{name}_stderr,{flt}")
            stderr = f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "-"
            lines.append(f"| {task} | {name} | {value:.4f} | {stderr} |")
    return "\n".join(lines) + "\n"


def harness(checkpoint: str, suite: str | None = None, tasks: list[str] | None = None,
            num_fewshot: int | None = None, batch_size: int = 4, limit: float | None = None, device: str = "cpu",
            include_path: str | None = None, out: str | None = None) -> dict:
    """Run lm-eval tasks (or a suite) on a checkpoint; write results.json and results.md.

    Args:
        checkpoint: A checkpoint, a run directory (its newest checkpoint) or an `lm export` directory.
        suite: A suite of eval/suites (standard, recall, long) or a suite YAML.
        tasks: lm-eval task names, instead of or besides a suite.
        num_fewshot: Shots (default: the suite's, else 0).
        batch_size: Sequences per forward pass (results do not depend on it).
        limit: At most this many documents per task (a fraction if below 1).
        device: Torch device.
        include_path: A folder of further task YAMLs (eval/tasks is always included).
        out: Output directory (default: RUN_DIR/eval/harness-SUITE).
    """
    # Every argument is checked before lm-eval is imported and its tasks loaded (seconds, and the network).
    spec = load_suite(suite) if suite else {"tasks": []}
    names = [t["task"] for t in spec["tasks"]] + list(tasks or [])
    if not names:
        raise UserError("nothing to run: give --suite or --tasks")
    if not Path(checkpoint).exists():
        raise UserError(f"checkpoint {checkpoint} not found")
    if batch_size < 1:
        raise UserError(f"--batch_size must be at least 1, got {batch_size}")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num_fewshot must be at least 0, got {num_fewshot}")
    if limit is not None and not limit > 0:
        raise UserError(f"--limit must be positive (documents per task, or a fraction below 1), got {limit}")
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include_path {include_path} is not a folder of task YAMLs")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")

    import logging

    import lm_eval

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notices would bury the results

    from lm.eval.harness import LMHarness
    from lm.eval.wandb_log import log_to_run
    from lm.training.checkpoint import run_dir_of

    manager = loaded_task_manager(names, [str(TASKS)] + ([include_path] if include_path else []),
                                  spec.get("metadata"))
    model = LMHarness(checkpoint=checkpoint, batch_size=batch_size, device=device)
    shots = num_fewshot if num_fewshot is not None else spec.get("num_fewshot", 0)
    evaluated = lm_eval.simple_evaluate(model=model, tasks=names, num_fewshot=shots, limit=limit,
                                       task_manager=manager, log_samples=False, bootstrap_iters=1000)
    results = evaluated["results"]
    metrics = {t["task"]: t.get("metric") for t in spec["tasks"]}
    out_dir = Path(out) if out else run_dir_of(checkpoint) / "eval" / f"harness-{Path(suite or 'tasks').stem}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(
        {"checkpoint": str(checkpoint), "suite": suite, "num_fewshot": shots, "limit": limit,
         "results": results, "versions": evaluated.get("versions", {})}, indent=1, default=str))
    table = markdown_table(results, metrics)
    (out_dir / "results.md").write_text(table)
    log_to_run(run_dir_of(checkpoint), out_dir.name, {
        f"{task}/{key.split(',')[0]}": value for task, values in results.items() for key, value in values.items()
        if "," in key and "_stderr" not in key and isinstance(value, (int, float))})
    print(f"lm eval harness: wrote results.json and results.md in {out_dir}", file=sys.stderr)
    print(table, end="")
    return results

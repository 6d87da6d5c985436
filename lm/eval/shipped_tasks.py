"""`lm eval tasks`: the lm-eval task YAMLs that ship with lm (eval/tasks in a checkout, inside the package in a wheel),
where they are and what they are, for lm-eval's own CLI: `lm_eval --include_path "$(lm eval tasks --path true)"`.

`lm eval harness` includes them by itself. lm-eval's CLI cannot be given them by the `lm` model: it resolves --tasks
with its TaskManager before it builds the model, so the folder has to be named on its command line."""

import re
import sys
from pathlib import Path

from lm.util.resources import shipped

TASKS = shipped("eval/tasks")
TASK_LINE = re.compile(r"^task:\s*([\w.-]+)\s*$", re.MULTILINE)


def shipped_tasks(folder: Path = TASKS) -> list[tuple[str, Path, str]]:
    """(task name, its YAML, the YAML's first comment line) of every task under `folder`, by name."""
    found = []
    for path in sorted(folder.rglob("*.yaml")):
        text = path.read_text()
        comment = next((line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")), "")
        found += [(name, path, comment) for name in TASK_LINE.findall(text)]
    return sorted(found)


def eval_tasks(path: bool = False) -> None:
    """Where lm's own lm-eval task YAMLs are, and their names; for lm_eval --include_path.

    Args:
        path: Print the folder alone (for `lm_eval --include_path "$(lm eval tasks --path true)"`).
    """
    if path:
        print(TASKS)
        return
    tasks = shipped_tasks()
    width = max((len(name) for name, _, _ in tasks), default=0)
    lines = [f"lm's lm-eval tasks: {TASKS}"]
    lines += [f"  {name:<{width}}  {comment}" for name, _, comment in tasks]
    lines += ["", "lm eval harness includes them; with lm-eval's own CLI:",
              '  lm_eval --model lm --model_args checkpoint=RUN --include_path "$(lm eval tasks --path true)" '
              "--tasks kjv_cloze"]
    sys.stdout.write("\n".join(lines) + "\n")

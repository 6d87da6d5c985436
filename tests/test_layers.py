"""lm's layers, lowest first: ops -> mixers -> model -> accounting -> training -> export, hf, eval, compare, bench, cli.
A module imports (at its top) only from its own layer and the ones below. A lazy import inside a function is allowed
where a lower layer hands work up on request (lm train's in-loop evaluation runs eval/in_loop.py)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [("lm.ops", "lm/ops"), ("lm.mixers", "lm/mixers"), ("lm.model", "lm/model.py"),
          ("lm.accounting", "lm/accounting"), ("lm.training", "lm/training")]
ABOVE_ALL = ("lm.export", "lm.generate", "lm.hf", "lm.compare", "lm.cli", "lm.demo", "eval", "bench", "slurm")


def top_level_imports(path: Path) -> set[str]:
    imports = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            imports |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imports.add(node.module)
    return imports


def files(where: str) -> list[Path]:
    path = ROOT / where
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


@pytest.mark.parametrize("index", range(len(LAYERS)), ids=[name for name, _ in LAYERS])
def test_a_layer_imports_nothing_above_it(index):
    above = [name for name, _ in LAYERS[index + 1:]] + list(ABOVE_ALL)
    for path in files(LAYERS[index][1]):
        wrong = {m for m in top_level_imports(path) for a in above if m == a or m.startswith(a + ".")}
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}, which build on it"

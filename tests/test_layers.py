"""The structure drawn from imports, over the whole of lm/: every import (at the top of a module or inside a function)
points to the same layer or one below it, and no modules import each other in a circle.

Layers, lowest first (docs/design.md, "Layers"): the shared helpers (lm.util: errors, shipped files, output, plots,
workers, the table of commands) -> ops -> mixers -> model -> accounting -> data_prep -> training -> generate, export, hf
-> eval -> slurm -> compare -> bench -> research -> the command line (lm.cli) and the start-up hook. A module of lm/
that no layer names fails too, so a new file has to take its place; lm's top level holds only the modules that stand
alone (the backbone, export, generation, the start-up hook)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    ("lm", "lm.util"),
    ("lm.ops",),
    ("lm.mixers", "lm.mixer_catalogue"),
    ("lm.model", "lm.model_config"),
    ("lm.accounting",),
    ("lm.data_prep",),
    ("lm.training",),
    ("lm.generate", "lm.export", "lm.hf"),
    ("lm.eval",),
    ("lm.slurm",),
    ("lm.compare",),
    ("lm.bench",),
    ("lm.research",),
    ("lm.cli", "lm.startup"),
]
# the modules that stand alone at lm/'s top; the model's config and the mixers' catalogue are apart from the model and
# the mixers because those import torch, and a config is checked without it
TOP_LEVEL = {"__init__", "model", "model_config", "mixer_catalogue", "export", "generate", "startup"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((ROOT / "lm").rglob("*.py"))}


def layer_of(module: str) -> int:
    """The layer that names the longest prefix of `module` ("lm" names lm/__init__.py alone)."""
    matches = [(len(prefix), i) for i, names in enumerate(LAYERS) for prefix in names
               if module == prefix or (prefix != "lm" and module.startswith(prefix + "."))]
    if not matches:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py")
    return max(matches)[1]


def imported_modules(module: str) -> set[str]:
    """lm's modules that `module` imports anywhere in its file (relative imports resolved)."""
    path, found = MODULES[module], set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]  # a module, or a name in the module `base`
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {module: imported_modules(module) for module in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_the_top_level_holds_only_what_stands_alone():
    """Loose files at lm/'s top level are the backbone and its config, the mixers' catalogue, export, generation and the
    start-up hook; the command line is
    lm.cli, the shared helpers lm.util, context parallelism lm.mixers.context_parallel."""
    assert {path.stem for path in (ROOT / "lm").glob("*.py")} == TOP_LEVEL


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_arrow_runs_up(module):
    up = sorted(name for name in GRAPH[module] if layer_of(name) > layer_of(module))
    assert not up, f"{module} (layer {layer_of(module)}) imports {up}, which build on it"


def test_no_circles():
    """Tarjan's strongly connected components: any of more than one module is a circle."""
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not circles, f"modules that import each other in a circle: {circles}"


def imported_on_load(module: str) -> set[str]:
    """Every module that importing `module` imports at once (the statements at the top of its file and of the files
    it loads, their packages' __init__ included, not those inside functions): lm's by name, others by their top
    package."""
    done, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        todo += [name.rpartition(".")[0]] if "." in name else []  # the package's __init__ runs first
        if name not in MODULES:
            continue
        for node in ast.parse(MODULES[name].read_text()).body:
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                todo += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names
                                         if f"{node.module}.{alias.name}" in MODULES]
    return {name if name.startswith("lm") else name.split(".")[0] for name in done}


@pytest.mark.parametrize("module", ["lm.eval.ppl", "lm.eval.harness", "lm.export", "lm.generate", "lm.slurm.status"])
def test_reading_a_checkpoint_does_not_load_lightning(module):
    """Evaluation, export, generation and `lm slurm status` read checkpoints and data without Lightning, whose import
    (torchmetrics, which pulls in transformers, scipy and matplotlib; torch._dynamo) costs each process about 2.5 s:
    the writer is lm.training.step_checkpoint, the data module lm.training.data_module."""
    loaded = imported_on_load(module)
    assert "lm.training.checkpoint" in loaded  # each reads checkpoints through it
    assert not {"lightning", "pytorch_lightning"} & loaded, sorted(m for m in loaded if m.startswith("lm"))


@pytest.mark.parametrize("module", ["lm.cli", "lm.cli.train", "lm.training.preflight"])
def test_lm_train_checks_a_launch_before_it_loads_lightning(module):
    """`lm train` parses its config and runs every check of the launch (lm.training.preflight) before it imports
    Lightning, DeepSpeed or transformers (lm.training.train, imported inside the command once the checks have
    passed), so that a mistake ends in one line within a second or two rather than after their import."""
    loaded = imported_on_load(module)
    assert module != "lm.cli.train" or "lm.training.config" in loaded
    assert not {"lightning", "pytorch_lightning", "deepspeed", "transformers"} & loaded, \
        sorted(m for m in loaded if m.startswith("lm"))


@pytest.mark.parametrize("module", ["lm.cli", "lm.cli.train", "lm.training.config"])
def test_lm_train_parses_and_checks_its_config_before_it_loads_torch(module):
    """The run config (lm.training.config: the model's, lm.model_config, with the mixers' names and options read from
    their sources by lm.mixer_catalogue; the data's, the strategy's) is parsed and checked without torch, whose import
    costs a process seconds: `lm train` imports lm.training.preflight, and with it torch, once the config has passed,
    so that a mistake in it ends in one line before (docs/training.md has the times)."""
    loaded = imported_on_load(module)
    assert module == "lm.cli" or {"lm.model_config", "lm.mixer_catalogue", "lm.training.data_config"} <= loaded
    assert not {"torch", "numpy", "lm.mixers", "lm.model", "lm.training.preflight"} & loaded, \
        sorted(m for m in loaded if m.startswith("lm"))

"""The mixers' names and their options' names, read from the sources of lm/mixers without importing them: importing
lm.mixers imports torch (seconds of a process's start), and a config's mixers are checked against this first
(lm.model_config), so that a mistyped mixer or option ends in one line before torch is loaded. The full check (the
registry, lm.mixers.MIXERS: each option's type, each mixer built on the meta device) follows for every config that
this one passes.

It reads what the mixer contract says a mixer writes (docs/design.md, "Mixer contract"): `@register("name")` on a
class at the top of a file, and that class's `Options`, a dataclass nested in it (or else its one base class's),
whose fields are the fields of the Options it extends (`class Options(GatedDeltaNet.Options)`) followed by its own
annotated names, in the order dataclasses gives them. It is a static read, not a second registry: where the sources
say anything else (a name that is not a literal, a class named twice, an Options it cannot follow), it answers "not
known" (None, or `complete` false) and the config is left to the full check, so that nothing the full check accepts is
refused here (tests/test_mixer_catalogue.py compares the two over every registered mixer). A mixer registered in the
process from outside lm/mixers (a test's) is the registry's alone: `known_mixers` leaves it, and every name the
registry holds, to the full check.
"""

import ast
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

SOURCES = Path(__file__).parent / "mixers"


@dataclass(frozen=True)
class Catalogue:
    """What the mixers' sources say. `options`: mixer name -> its options' names in the order of its Options' fields,
    or None where they are not known here; `complete`: every registration in the sources names its mixer by a literal,
    so that a name missing here is no mixer of lm's."""

    options: dict[str, tuple[str, ...] | None]
    complete: bool


def called(node: ast.expr) -> str | None:
    """The name a decorator or call uses: `register` for register("x"), `dataclass` for dataclasses.dataclass()."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


@functools.cache
def read_catalogue(sources: Path = SOURCES) -> Catalogue:
    """The catalogue of the mixers registered in the files of `sources` (a few milliseconds: no import)."""
    classes: dict[str, ast.ClassDef | None] = {}  # top-level class name -> its definition (None: defined twice)
    mixers: dict[str, str | None] = {}  # mixer name -> its class's name (None: registered twice)
    complete = True
    for path in sorted(sources.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        decorators = set()
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            classes[node.name] = None if node.name in classes else node
            for decorator in node.decorator_list:
                if called(decorator) == "register" and literal_name(decorator):
                    name = literal_name(decorator)
                    mixers[name] = None if name in mixers else node.name
                    decorators.add(decorator)
        # any other registration (a name in a variable, register("x")(cls) in a function) names what we cannot see
        if any(isinstance(node, ast.Call) and called(node) == "register" and node not in decorators
               for node in ast.walk(tree)):
            complete = False
    return Catalogue({name: mixer_options(cls, classes, ()) if cls else None for name, cls in mixers.items()},
                     complete)


def literal_name(decorator: ast.expr) -> str | None:
    """"x" of @register("x"), or None where the name is not one string literal."""
    if isinstance(decorator, ast.Call) and len(decorator.args) == 1 and not decorator.keywords:
        arg = decorator.args[0]
        return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
    return None


def mixer_options(name: str, classes: dict[str, ast.ClassDef | None], seen: tuple[str, ...]) -> tuple[str, ...] | None:
    """The option names of the mixer class `name`: its own nested Options, or else those of its one base class."""
    node = classes.get(name)
    if node is None or name in seen:
        return None
    own = [n for n in node.body if isinstance(n, ast.ClassDef) and n.name == "Options"]
    if own:
        return options_fields(own[-1], classes, (*seen, name))
    if any(assigns_options(n) for n in node.body):
        return None  # Options set some other way (the protocol's `Options: type = NoOptions`)
    bases = [called(base) for base in node.bases]
    return mixer_options(bases[0], classes, (*seen, name)) if len(bases) == 1 and bases[0] else None


def assigns_options(node: ast.stmt) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(target, ast.Name) and target.id == "Options" for target in targets)


def options_fields(node: ast.ClassDef, classes: dict[str, ast.ClassDef | None],
                   seen: tuple[str, ...]) -> tuple[str, ...] | None:
    """The fields of a nested Options dataclass: those of the Options it extends (`Parent.Options`), then its own."""
    if not any(called(d) == "dataclass" for d in node.decorator_list):
        return None
    names: list[str] = []
    for base in node.bases:
        parent = base.value.id if isinstance(base, ast.Attribute) and base.attr == "Options" and \
            isinstance(base.value, ast.Name) else None
        inherited = mixer_options(parent, classes, seen) if parent else None
        if inherited is None:
            return None
        names += [n for n in inherited if n not in names]
    own = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return tuple(names + [n for n in own if n not in names])


def known_mixers() -> Catalogue:
    """The catalogue of this process: lm/mixers' sources, and every mixer in the registry where lm.mixers is loaded
    (a mixer from outside lm/mixers registers itself through it), with no options known, so that the registry alone
    judges them (a test's mixer, or one of lm's registered again under its name)."""
    static = read_catalogue()
    protocol = sys.modules.get("lm.mixers.protocol")
    registered = dict.fromkeys(protocol.MIXERS) if protocol is not None else {}
    return Catalogue({**static.options, **registered}, static.complete)

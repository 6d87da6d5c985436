"""A data recipe (`lm prepare --recipe FILE`, e.g. configs/data/slimpajama.yaml): several sources prepared with one
tokenizer, each into its own dataset (OUT/<name>/), plus OUT/mixture.yaml giving each source its weight for
`lm train --config ... --config OUT/mixture.yaml`. A source is either the records of one corpus whose field holds its
value, routed in one pass:

    field: meta.redpajama_set_name        # dotted path in each JSON record
    tokenizer: gpt2                       # optional: a tokenizer.json path or hub name; absent or null: train a BPE
    inputs: [SlimPajama-627B/train/chunk*/*.jsonl.zst]   # optional: used when the command gives none
    sources:
      - {name: common_crawl, value: RedPajamaCommonCrawl, weight: 0.522}
      ...

or, without `field`, files of its own (paths, directories or globs, relative to where lm prepare runs):

    sources:
      - {name: books, inputs: [books/], weight: 0.7}
      - {name: code, inputs: ["code/*.jsonl.zst"], weight: 0.3}

Without `tokenizer`, one BPE is trained over every source's documents (or over a sample of them, shared out by
weight), so that the datasets can be mixed. Records whose field holds none of the values are left out (and counted)."""

from dataclasses import dataclass
from pathlib import Path

import yaml

from lm.util.config_errors import load_yaml
from lm.util.errors import UserError
from lm.util.output import write_atomically
from lm.util.resources import shipped

MIXTURE = "mixture.yaml"
KEYS = {"field", "tokenizer", "inputs", "sources"}


@dataclass(frozen=True)
class RecipeSource:
    name: str  # its directory under OUT, and its name in mixture.yaml
    value: str | None  # the field's value that selects its records (None: its records are those of its inputs)
    weight: float
    inputs: tuple[str, ...] = ()  # its files, in a recipe without a field

    @property
    def group(self) -> str:
        """What routes a record here: the field's value, or (a recipe without a field) the source's name."""
        return self.value if self.value is not None else self.name


@dataclass(frozen=True)
class Recipe:
    path: Path
    field: str | None  # None: each source names its own inputs
    sources: tuple[RecipeSource, ...]
    tokenizer: str | None = None
    inputs: tuple[str, ...] = ()


def recipe_file(path: str) -> Path:
    """The file `path` names, else the shipped copy of a relative path (configs/data/slimpajama.yaml from a wheel)."""
    file = Path(path)
    if not file.is_file() and not file.is_absolute() and shipped(path).is_file():
        file = shipped(path)
    if not file.is_file():
        raise UserError(f"recipe file {path} not found")
    return file


def load_recipe(path: str) -> Recipe:
    """The recipe, checked: one clear line for a missing file, an unknown key or a bad source."""
    file = recipe_file(path)
    raw = load_yaml(file) or {}  # a syntax error: "FILE, line N: what"
    if not isinstance(raw, dict) or set(raw) - KEYS or "sources" not in raw:
        raise UserError(f"recipe {file}: needs `sources` (may have {', '.join(sorted(KEYS))})")
    field = raw.get("field")
    if field is not None and (not isinstance(field, str) or not field):
        raise UserError(f"recipe {file}: `field` must be a field name (a dotted path)")
    if not isinstance(raw["sources"] or [], list):
        raise UserError(f"recipe {file}: `sources` must be a list")
    sources = tuple(recipe_source(item, file, field) for item in raw["sources"] or ())
    if not sources:
        raise UserError(f"recipe {file}: `sources` must list at least one source")
    for key in ("name", "value"):
        seen = [getattr(s, key) for s in sources if getattr(s, key) is not None]
        if len(set(seen)) < len(seen):
            raise UserError(f"recipe {file}: two sources share a {key}")
    inputs = raw.get("inputs") or ()
    if not is_paths(inputs):
        raise UserError(f"recipe {file}: `inputs` must be a list of paths or globs")
    if inputs and field is None:
        raise UserError(f"recipe {file}: `inputs` belongs to a recipe with a `field`; without one, each source "
                        "names its own inputs")
    return Recipe(file, field, sources, raw.get("tokenizer"), tuple(inputs))


def is_paths(value) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(i, str) for i in value)


def recipe_source(item, file: Path, field: str | None) -> RecipeSource:
    """One entry of `sources`: a plain directory name, a positive weight, and the field's value that selects its
    records (a recipe with a field) or its own non-empty `inputs` (a recipe without)."""
    keys = {"name", "value" if field is not None else "inputs", "weight"}
    if not isinstance(item, dict) or set(item) != keys:
        shape = "{" + ", ".join(sorted(keys, key=["name", "value", "inputs", "weight"].index)) + "}"
        why = "" if field is not None else " (a recipe without `field` gives each source its inputs)"
        raise UserError(f"recipe {file}: each source is {shape}{why}, got {item!r}")
    name, weight = item["name"], item["weight"]
    if not isinstance(name, str) or not name or Path(name).name != name or name.startswith("."):
        raise UserError(f"recipe {file}: source name {name!r} must be a plain directory name")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
        raise UserError(f"recipe {file}: source {name}: weight must be a positive number, got {weight!r}")
    if field is None:
        if not is_paths(item["inputs"]) or not item["inputs"]:
            raise UserError(f"recipe {file}: source {name}: inputs must be a non-empty list of paths or globs, got "
                            f"{item['inputs']!r}")
        return RecipeSource(name, None, float(weight), tuple(item["inputs"]))
    if not isinstance(item["value"], str):
        raise UserError(f"recipe {file}: source {name}: value must be text, got {item['value']!r}")
    return RecipeSource(name, item["value"], float(weight))


def write_mixture(out: Path, recipe: Recipe) -> dict:
    """OUT/mixture.yaml: each source's prepared directory (absolute) and weight, as `lm train` reads data.sources."""
    mixture = {"data": {"sources": [{"name": s.name, "path": str((out / s.name).resolve()), "weight": s.weight}
                                    for s in recipe.sources]}}
    text = yaml.safe_dump(mixture, default_flow_style=None, sort_keys=False, width=1000)
    write_atomically(out / MIXTURE, lambda tmp: tmp.write_text(text))
    return mixture

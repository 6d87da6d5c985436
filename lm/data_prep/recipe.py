"""A data recipe (`lm prepare --recipe FILE`, e.g. configs/data/slimpajama.yaml): one corpus whose records name their
source in a field, prepared in one pass into a dataset per source (OUT/<name>/, one tokenizer), plus OUT/mixture.yaml
giving each source its weight for `lm train --config ... --config OUT/mixture.yaml`.

    field: meta.redpajama_set_name        # dotted path in each JSON record
    tokenizer: gpt2                       # optional: a tokenizer.json path or hub name; absent or null: train a BPE
    inputs: [SlimPajama-627B/train/chunk*/*.jsonl.zst]   # optional: used when the command gives none
    sources:
      - {name: common_crawl, value: RedPajamaCommonCrawl, weight: 0.522}
      ...

Records whose field holds none of the values are left out (and counted)."""

from dataclasses import dataclass
from pathlib import Path

import yaml

from lm.errors import UserError
from lm.output import write_atomically
from lm.resources import shipped

MIXTURE = "mixture.yaml"
KEYS = {"field", "tokenizer", "inputs", "sources"}


@dataclass(frozen=True)
class RecipeSource:
    name: str  # its directory under OUT, and its name in mixture.yaml
    value: str  # the field's value that selects its records
    weight: float


@dataclass(frozen=True)
class Recipe:
    path: Path
    field: str
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
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"recipe {file} is not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(raw, dict) or set(raw) - KEYS or not {"field", "sources"} <= set(raw):
        raise UserError(f"recipe {file}: needs `field` and `sources` (may have {', '.join(sorted(KEYS))})")
    if not isinstance(raw["field"], str) or not raw["field"]:
        raise UserError(f"recipe {file}: `field` must be a field name (a dotted path)")
    sources = tuple(recipe_source(item, file) for item in raw["sources"] or ())
    if not sources:
        raise UserError(f"recipe {file}: `sources` must list at least one {{name, value, weight}}")
    for key in ("name", "value"):
        seen = [getattr(s, key) for s in sources]
        if len(set(seen)) < len(seen):
            raise UserError(f"recipe {file}: two sources share a {key}")
    inputs = raw.get("inputs") or ()
    if isinstance(inputs, str) or not all(isinstance(i, str) for i in inputs):
        raise UserError(f"recipe {file}: `inputs` must be a list of paths or globs")
    return Recipe(file, raw["field"], sources, raw.get("tokenizer"), tuple(inputs))


def recipe_source(item, file: Path) -> RecipeSource:
    """One entry of `sources`: a plain directory name, the field's value, a positive weight."""
    if not isinstance(item, dict) or set(item) != {"name", "value", "weight"}:
        raise UserError(f"recipe {file}: each source is {{name, value, weight}}, got {item!r}")
    name, value, weight = item["name"], item["value"], item["weight"]
    if not isinstance(name, str) or not name or Path(name).name != name or name.startswith("."):
        raise UserError(f"recipe {file}: source name {name!r} must be a plain directory name")
    if not isinstance(value, str):
        raise UserError(f"recipe {file}: source {name}: value must be text, got {value!r}")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
        raise UserError(f"recipe {file}: source {name}: weight must be a positive number, got {weight!r}")
    return RecipeSource(name, value, float(weight))


def write_mixture(out: Path, recipe: Recipe) -> dict:
    """OUT/mixture.yaml: each source's prepared directory (absolute) and weight, as `lm train` reads data.sources."""
    mixture = {"data": {"sources": [{"name": s.name, "path": str((out / s.name).resolve()), "weight": s.weight}
                                    for s in recipe.sources]}}
    text = yaml.safe_dump(mixture, default_flow_style=None, sort_keys=False, width=1000)
    write_atomically(out / MIXTURE, lambda tmp: tmp.write_text(text))
    return mixture

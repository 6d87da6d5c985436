"""Write configs/<mixer>/<size>.yaml for every recurrent mixer (and hybrid) at the MesaNet paper's sizes, each matched
to the attention model of the same size (configs/attention/<size>.yaml) within 2% of its parameters by the MLP width.
Then set the micro_batch of every 400M and 1B config (attention's too) to what fits an 80 GB GPU by the memory plan
(lm.accounting.memory), with the 80 GB and 141 GB fits in a comment on that line.

    python -m lm.compare.paper_sizes        # rewrites the files; tests/test_configs.py checks the match
"""

import re
from dataclasses import asdict, replace
from pathlib import Path

import yaml

from lm.accounting.flops import param_count
from lm.accounting.memory import micro_batch_fits
from lm.accounting.sizing import match_params_by_mlp, whole_patterns
from lm.mixers import MIXERS
from lm.model import LMConfig
from lm.util.resources import shipped

HERE = shipped("configs")
SIZES = ("145m", "400m", "1b")


def mixer_shape(mixer: str, attention: LMConfig) -> dict:
    """Each mixer with its paper's defaults and the paper's key size 128. A mixer whose paper has keys of d/2 and
    values of d (Gated DeltaNet, GLA: `paper_heads` 0.5) has half the heads, of 128 keys, and expand_v 2."""
    return {"n_heads": max(1, int(attention.n_heads * MIXERS[mixer].paper_heads))}


# Hybrids: a config name -> the layer pattern repeated over the depth (in whole patterns); HYBRID_SOURCES cites
# where each layout comes from (docs/mesa.md, "Hawk-Mesa's layout").
HYBRIDS = {"hawk_mesa": "hawk,mesa", "mesa_attention": "mesa,attention"}
HYBRID_SOURCES = {  # lines for the header of a hybrid's generated configs
    "hawk_mesa": "# Layout: Hawk and Mesa blocks alternate 1:1, as the MesaNet paper (arXiv 2506.05233 v2)\n"
                 "# says in Sec. 4 and App. E.1/G.2 (\"simply alternates between blocks that have either a LRU\n"
                 "# layer or a Mesa layer\"); which comes first is not stated, lm starts with Hawk.\n",
    "mesa_attention": "# Layout: lm's own hybrid (Mesa and softmax attention alternate 1:1), not a model of the\n"
                      "# MesaNet paper.\n",
}
PAPER_HYBRIDS = ("hawk_mesa",)  # the MesaNet paper's rows (Hawk-Mesa), which `lm compare demo` compares too


def generated() -> list[str]:
    """The config names this writes: every registered mixer but attention (each matched to it), then the hybrids."""
    return [*(m for m in MIXERS if m != "attention"), *HYBRIDS]


def config_text(name: str, size: str) -> str:
    """What `write` puts in configs/<name>/<size>.yaml (before `set_micro_batch`)."""
    base = yaml.safe_load((HERE / "attention" / f"{size}.yaml").read_text())
    attention = LMConfig(**base["model"])
    pattern = HYBRIDS.get(name)
    mixer = pattern.split(",")[0] if pattern else name
    depth = whole_patterns(attention.n_layers, len(pattern.split(","))) if pattern else attention.n_layers
    cfg = replace(attention, mixer=mixer, layer_pattern=pattern, n_layers=depth, **mixer_shape(mixer, attention))
    cfg = match_params_by_mlp(cfg, param_count(attention))
    keep = ("mlp_ratio", "n_heads", "layer_pattern")
    base["model"] = {k: v for k, v in asdict(cfg).items() if k in base["model"] or (k in keep and v is not None)}
    base["run_dir"] = f"runs/{name}-{size}"
    header = (f"# {pattern or mixer} at the MesaNet paper's {size} size: the attention config's backbone,\n"
              f"# recipe and data, with the MLP width matched to its {param_count(attention):,} parameters\n"
              f"# (here {param_count(cfg):,}). Written by python -m lm.compare.paper_sizes.\n"
              + (f"# {depth} layers rather than {attention.n_layers}: whole {pattern} patterns.\n"
                 if depth != attention.n_layers else "")
              + HYBRID_SOURCES.get(name, ""))
    return header + yaml.safe_dump(base, sort_keys=False)


def write(name: str, size: str) -> Path:
    path = HERE / name / f"{size}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(config_text(name, size))
    return path


GPU_GIB = (80, 141)  # an H100's memory and an H200's


def memory_fits(text: str) -> dict[str, int]:
    """The largest micro_batch of this config (its text) at its seq_len on one GPU of each size, without and with
    activation checkpointing (bf16-mixed, one process)."""
    raw = yaml.safe_load(text)
    return micro_batch_fits(LMConfig(**raw["model"]), raw["data"]["seq_len"], GPU_GIB)


def with_micro_batch(text: str) -> tuple[str, int]:
    """The config's text with micro_batch := the largest power of two that fits 80 GB (1 if none does), the fits in
    a comment on its line; and that micro_batch."""
    fits = memory_fits(text)
    micro_batch = 1 << max(0, fits["fits_80gib"].bit_length() - 1)
    note = (f"fits {fits['fits_80gib']} at 80 GB, {fits['fits_141gib']} at 141 GB; with activation checkpointing "
            f"{fits['fits_80gib_ckpt']} and {fits['fits_141gib_ckpt']}")
    return re.sub(r"(?m)^  micro_batch: .*$", f"  micro_batch: {micro_batch}   # {note} (lm bench plan-memory)",
                  text), micro_batch


def set_micro_batch(path: Path) -> int:
    text, micro_batch = with_micro_batch(path.read_text())
    path.write_text(text)
    return micro_batch


if __name__ == "__main__":
    for name in generated():
        for size in SIZES:
            print(write(name, size))
    for path in sorted(HERE.glob("*/400m.yaml")) + sorted(HERE.glob("*/1b.yaml")):
        print(path, "micro_batch", set_micro_batch(path))

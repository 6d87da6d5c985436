"""Write configs/<mixer>/<size>.yaml for every recurrent mixer (and hybrid) at the MesaNet paper's sizes, each matched
to the attention model of the same size (configs/attention/<size>.yaml) within 2% of its parameters by the MLP width.

    python configs/paper_sizes.py        # rewrites the files; tests/test_configs.py checks the match
"""

from dataclasses import asdict, replace
from pathlib import Path

import yaml

from lm.accounting.flops import param_count
from lm.accounting.sizing import match_params_by_mlp
from lm.mixers import MIXERS
from lm.model import LMConfig

HERE = Path(__file__).parent
SIZES = ("145m", "400m", "1b")


def mixer_shape(mixer: str, attention: LMConfig) -> dict:
    """Each mixer with its paper's defaults and the paper's key size 128. A mixer whose paper has keys of d/2 and
    values of d (Gated DeltaNet, GLA: `paper_heads` 0.5) has half the heads, of 128 keys, and expand_v 2."""
    return {"n_heads": max(1, int(attention.n_heads * MIXERS[mixer].paper_heads))}


# Hybrids: a config name -> the layer pattern cycled over the depth.
HYBRIDS = {"hawk_mesa": "hawk,mesa", "mesa_attention": "mesa,attention"}
PAPER_HYBRIDS = ("hawk_mesa",)  # the MesaNet paper's rows (Hawk-Mesa), which `lm compare demo` compares too


def write(name: str, size: str) -> Path:
    base = yaml.safe_load((HERE / "attention" / f"{size}.yaml").read_text())
    attention = LMConfig(**base["model"])
    pattern = HYBRIDS.get(name)
    mixer = pattern.split(",")[0] if pattern else name
    cfg = replace(attention, mixer=mixer, layer_pattern=pattern, **mixer_shape(mixer, attention))
    cfg = match_params_by_mlp(cfg, param_count(attention))
    keep = ("mlp_ratio", "n_heads", "layer_pattern")
    base["model"] = {k: v for k, v in asdict(cfg).items() if k in base["model"] or (k in keep and v is not None)}
    base["run_dir"] = f"runs/{name}-{size}"
    header = (f"# {pattern or mixer} at the MesaNet paper's {size} size: the attention config's backbone,\n"
              f"# recipe and data, with the MLP width matched to its {param_count(attention):,} parameters\n"
              f"# (here {param_count(cfg):,}). Written by configs/paper_sizes.py.\n")
    path = HERE / name / f"{size}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(header + yaml.safe_dump(base, sort_keys=False))
    return path


if __name__ == "__main__":
    for name in (*(m for m in MIXERS if m != "attention"), *HYBRIDS):  # each matched to attention
        for size in SIZES:
            print(write(name, size))

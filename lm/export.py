"""`lm export`: a checkpoint of any strategy -> model.safetensors + config.json (+ tokenizer.json), the directory
that `LanguageModel.from_pretrained` reads; with `--format hf`, a Hugging Face directory (lm/hf/export.py)."""

import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from safetensors.torch import save_file

from lm.model import LMConfig
from lm.training.checkpoint import resolve_checkpoint, run_dir_of
from lm.training.consolidate import consolidate
from lm.util.errors import UserError
from lm.util.output import user_mode, write_json

WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.json"


def save_pretrained(state_dict: dict, config: LMConfig, out: str | Path, tokenizer: str | Path | None = None) -> Path:
    """Write the weights (float32, tied tensors stored once each as plain copies) and the model config."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}, str(out / WEIGHTS),
              metadata={"format": "pt"})
    user_mode(out / WEIGHTS)
    write_json(out / CONFIG, asdict(config))
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, out / TOKENIZER)
    return out


def export(checkpoint: str, out: str, format: Literal["lm", "hf"] = "lm") -> str:
    """Consolidate a checkpoint (single device, DDP, DeepSpeed ZeRO 1-3 or FSDP2) into a pretrained directory.

    Args:
        checkpoint: A checkpoint (step=N.ckpt, a file or a directory of shards) or a run directory (its newest).
        out: Directory to write into.
        format: "lm": model.safetensors, config.json and tokenizer.json, for LanguageModel.from_pretrained. "hf": a
            Hugging Face directory (lm/hf/export.py) for transformers' AutoModelForCausalLM and AutoTokenizer, which
            LanguageModel.from_pretrained reads too.
    """
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    path = resolve_checkpoint(checkpoint)
    tokenizer = run_dir_of(path) / TOKENIZER
    if format == "hf" and not tokenizer.is_file():
        raise UserError(f"--format hf needs the run's tokenizer, and {tokenizer} is missing")
    state_dict, hparams = consolidate(path)
    config = LMConfig(**hparams["model"])
    if format == "hf":
        from lm.hf.export import save_hf

        written = save_hf(state_dict, config, out, tokenizer)
    else:
        written = save_pretrained(state_dict, config, out, tokenizer)
    print(f"exported {path} -> {written} ({format} format)")
    return str(written)

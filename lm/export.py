"""`lm export`: a checkpoint of any strategy -> model.safetensors + config.json (+ tokenizer.json), the directory
that `LanguageModel.from_pretrained` reads."""

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import save_file

from lm.checkpoint import resolve_checkpoint, run_dir_of
from lm.consolidate import consolidate
from lm.model import LMConfig

WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.json"


def save_pretrained(state_dict: dict, config: LMConfig, out: str | Path, tokenizer: str | Path | None = None) -> Path:
    """Write the weights (float32, tied tensors stored once each as plain copies) and the model config."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}, str(out / WEIGHTS),
              metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(asdict(config), indent=2) + "\n")
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, out / TOKENIZER)
    return out


def export(checkpoint: str, out: str) -> str:
    """Consolidate a checkpoint (single device, DDP, DeepSpeed ZeRO 1-3 or FSDP2) into a pretrained directory.

    Args:
        checkpoint: A checkpoint (step=N.ckpt, a file or a directory of shards) or a run directory (its newest).
        out: Directory to write model.safetensors, config.json and tokenizer.json into.
    """
    path = resolve_checkpoint(checkpoint)
    state_dict, hparams = consolidate(path)
    written = save_pretrained(state_dict, LMConfig(**hparams["model"]), out, run_dir_of(path) / TOKENIZER)
    print(f"exported {path} -> {written}")
    return str(written)

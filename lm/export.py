"""`lm export`: a checkpoint of any strategy -> model.safetensors + config.json (+ tokenizer.json), the directory
that `LanguageModel.from_pretrained` reads; with `--format hf`, a Hugging Face directory (lm/hf/export.py).

The weights file records where it came from (its header's metadata: the checkpoint, the sha256 of what the
checkpoint holds, the format), so that an export never silently replaces another model: an `--out` that is not empty
must hold an export of the same checkpoint in the same format, else `--overwrite true` is needed."""

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lm.data_prep.shards import sha256_file
from lm.model import LMConfig
from lm.training.checkpoint import manifest_of, resolve_checkpoint, run_dir_of
from lm.training.consolidate import consolidate
from lm.util.errors import UserError
from lm.util.output import user_mode, write_json

WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.json"
SOURCE = "lm_export"  # the key of the weights' metadata that names the checkpoint and format


def export_source(checkpoint: Path, format: str) -> dict:
    """What an export of `checkpoint` records: its path, the sha256 of its manifest (which holds every file's
    sha256; of the file itself for a checkpoint from before manifests) and the format."""
    manifest = manifest_of(checkpoint)
    digest = sha256_file(manifest if manifest.is_file() else checkpoint)
    return {"checkpoint": str(checkpoint.resolve()), "sha256": digest, "format": format}


def recorded_source(out: Path) -> dict | None:
    """The source an earlier export recorded in OUT's weights, or None (no weights, unreadable, not recorded)."""
    try:
        with safe_open(str(out / WEIGHTS), framework="pt") as f:
            source = json.loads((f.metadata() or {})[SOURCE])
    except (OSError, SafetensorError, KeyError, ValueError):
        return None
    return source if isinstance(source, dict) else None


def check_out(out: Path, source: dict, overwrite: bool) -> None:
    """One line unless OUT is new, empty, or an earlier export of the same checkpoint in the same format (or
    overwrite): as `lm prepare` never replaces another dataset."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    if overwrite or not out.is_dir() or not any(out.iterdir()):
        return
    earlier = recorded_source(out)
    if earlier is None:
        held = (f"a model whose {WEIGHTS} records no checkpoint of lm export" if (out / WEIGHTS).is_file() else
                "files that are not an export")
    elif earlier.get("sha256") != source["sha256"]:
        held = f"an export of another checkpoint ({earlier.get('checkpoint')})"
    elif earlier.get("format") != source["format"]:
        held = f"this checkpoint's export in {earlier.get('format')} format"
    else:
        return  # the same export again
    raise UserError(f"--out {out} already holds {held}: choose another --out or pass --overwrite true")


def save_pretrained(state_dict: dict, config: LMConfig, out: str | Path, tokenizer: str | Path | None = None,
                    metadata: dict[str, str] | None = None) -> Path:
    """Write the weights (float32, tied tensors stored once each as plain copies) and the model config; `metadata`
    goes into the weights' header (weights_metadata)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}, str(out / WEIGHTS),
              metadata=metadata or weights_metadata(None))
    user_mode(out / WEIGHTS)
    write_json(out / CONFIG, asdict(config))
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, out / TOKENIZER)
    return out


def weights_metadata(source: dict | None) -> dict[str, str]:
    """The safetensors header's metadata: the framework, and the export's source when there is one."""
    return {"format": "pt", **({SOURCE: json.dumps(source)} if source is not None else {})}


def export(checkpoint: str, out: str, format: Literal["lm", "hf"] = "lm", overwrite: bool = False) -> str:
    """Consolidate a checkpoint (single device, DDP, DeepSpeed ZeRO 1-3 or FSDP2) into a pretrained directory.

    Args:
        checkpoint: A checkpoint (step=N.ckpt, a file or a directory of shards) or a run directory (its newest).
        out: Directory to write into.
        format: "lm": model.safetensors, config.json and tokenizer.json, for LanguageModel.from_pretrained. "hf": a
            Hugging Face directory (lm/hf/export.py) for transformers' AutoModelForCausalLM and AutoTokenizer, which
            LanguageModel.from_pretrained reads too.
        out: Directory to write into: new, empty, or holding an earlier export of the same checkpoint in the same
            format (which is replaced); anything else needs --overwrite.
        overwrite: Write into an --out that holds another model or other files (files of the export's names are
            replaced; others stay).
    """
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    path = resolve_checkpoint(checkpoint)
    source = export_source(path, format)
    check_out(Path(out), source, overwrite)
    tokenizer = run_dir_of(path) / TOKENIZER
    if format == "hf" and not tokenizer.is_file():
        raise UserError(f"--format hf needs the run's tokenizer, and {tokenizer} is missing")
    state_dict, hparams = consolidate(path)
    config = LMConfig(**hparams["model"])
    if format == "hf":
        from lm.hf.export import save_hf

        written = save_hf(state_dict, config, out, tokenizer, weights_metadata(source))
    else:
        written = save_pretrained(state_dict, config, out, tokenizer, weights_metadata(source))
    print(f"exported {path} -> {written} ({format} format)", file=sys.stderr)  # where it wrote; stdout stays empty
    return str(written)

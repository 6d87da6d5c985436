"""One full, unsharded set of weights from a checkpoint of any strategy.

Formats: a plain Lightning file (single device, DDP); a DeepSpeed ZeRO directory (`checkpoint/` of per-rank
shards, consolidated by DeepSpeed's own zero_to_fp32 through Lightning's converter); an FSDP2 directory
(torch.distributed.checkpoint shards + Lightning's meta.pt, read with DCP's converter).
"""

import tempfile
from pathlib import Path

import torch

from lm.errors import UserError

PREFIX = "model."  # the LanguageModel inside LMModule


def checkpoint_format(path: str | Path) -> str:
    """"plain", "deepspeed" or "dcp"."""
    path = Path(path)
    if path.is_file():
        return "plain"
    if (path / "checkpoint").is_dir() and (path / "latest").is_file():
        return "deepspeed"
    if (path / ".metadata").is_file() and (path / "meta.pt").is_file():
        return "dcp"
    raise UserError(f"{path} is not a checkpoint written by lm train")


def checkpoint_world_size(path: str | Path) -> int | None:
    """Processes that wrote a sharded checkpoint (None for a plain file, which any world size can read)."""
    path, kind = Path(path), checkpoint_format(path)
    if kind == "deepspeed":
        return len(list((path / "checkpoint").glob("*zero_pp_rank_*_optim_states.pt")))
    if kind == "dcp":
        return len(list(path.glob("__*_*.distcp")))
    return None


def deepspeed_stage(path: str | Path) -> int:
    """The ZeRO stage a DeepSpeed checkpoint was written with."""
    shard = next(iter(sorted((Path(path) / "checkpoint").glob("*zero_pp_rank_0_*optim_states.pt"))))
    return int(torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]["zero_stage"])


def full_checkpoint(path: str | Path) -> dict:
    """The checkpoint as one Lightning checkpoint dict whose `state_dict` holds full float32 weights (loops,
    callbacks, data position, RNG and hyperparameters as saved; a plain file's optimizer state too)."""
    path, kind = Path(path), checkpoint_format(path)
    try:
        if kind == "plain":
            return torch.load(path, map_location="cpu", weights_only=False)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "full.ckpt"
            if kind == "deepspeed":
                from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

                convert_zero_checkpoint_to_fp32_state_dict(path, out, tag="checkpoint")
                return torch.load(out, map_location="cpu", weights_only=False)
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(path, out)
            shards = torch.load(out, map_location="cpu", weights_only=False)
            checkpoint = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
            checkpoint["state_dict"] = shards["state_dict"]
            return checkpoint
    except UserError:
        raise
    except Exception as err:  # a damaged shard surfaces here as whatever the reader raises
        raise UserError(f"cannot read checkpoint {path}: {' '.join(str(err).split())[:200]}") from None


def consolidate(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(the LanguageModel's state_dict, the run's hyperparameters) from a checkpoint of any strategy."""
    checkpoint = full_checkpoint(path)
    state = {k[len(PREFIX):]: v.float() if v.is_floating_point() else v
             for k, v in checkpoint["state_dict"].items() if k.startswith(PREFIX)}
    return state, checkpoint["hyper_parameters"]

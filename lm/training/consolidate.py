"""One full, unsharded set of weights from a checkpoint of any strategy.

Formats: a plain Lightning file (single device, DDP); a DeepSpeed ZeRO directory (`checkpoint/` of per-rank
shards, consolidated by DeepSpeed's own zero_to_fp32, as Lightning's converter does); an FSDP2 directory
(torch.distributed.checkpoint shards + Lightning's meta.pt, read as DCP's converter does). All in memory: nothing is
written. Every file is read as data only (lm.training.data_only), and checked for that before any library reads it.
"""

import contextlib
import sys
from pathlib import Path

import torch

from lm.training.data_only import load, reading_data_only, require_data_only
from lm.util.errors import UserError

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
    return int(load(shard, mmap=True)["optimizer_state_dict"]["zero_stage"])


def full_checkpoint(path: str | Path) -> dict:
    """The checkpoint as one Lightning checkpoint dict whose `state_dict` holds full float32 weights (loops,
    callbacks, data position, RNG and hyperparameters as saved; a plain file's optimizer state too). A checkpoint
    that names anything beyond data is refused (UserError) before any of it is used."""
    path, kind = Path(path), checkpoint_format(path)
    require_data_only(path)
    try:
        if kind == "plain":
            return load(path)
        with reading_data_only():
            return _deepspeed_checkpoint(path) if kind == "deepspeed" else _dcp_checkpoint(path)
    except UserError:
        raise
    except Exception as err:  # a damaged shard surfaces here as whatever the reader raises
        raise UserError(f"cannot read checkpoint {path}: {' '.join(str(err).split())[:200]}") from None


def _deepspeed_checkpoint(path: Path) -> dict:
    """What Lightning's convert_zero_checkpoint_to_fp32_state_dict returns, without writing its file: rank 0's
    client state (Lightning's loops, callbacks, hyperparameters) with DeepSpeed's consolidated fp32 weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, get_model_state_file

    with contextlib.redirect_stdout(sys.stderr):  # its progress lines are notices; stdout is the command's result
        weights = get_fp32_state_dict_from_zero_checkpoint(str(path), tag="checkpoint")
    client = load(get_model_state_file(str(path / "checkpoint"), deepspeed_stage(path)))
    checkpoint = {key: value for key, value in client.items() if key not in DEEPSPEED_OWN}
    checkpoint["state_dict"] = {key.removeprefix("_forward_module."): value for key, value in weights.items()}
    return checkpoint


# What DeepSpeed keeps in its model-state file beside Lightning's client state (as Lightning's converter drops them).
DEEPSPEED_OWN = ("module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps", "global_steps",
                 "dp_world_size", "mp_world_size")


def _dcp_checkpoint(path: Path) -> dict:
    """Lightning's meta.pt with the weights of DCP's shards, loaded in memory as DCP's dcp_to_torch_save does."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    shards: dict = {}
    _load_state_dict(shards, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    checkpoint = load(path / "meta.pt")
    checkpoint["state_dict"] = shards["state_dict"]
    return checkpoint


def consolidate(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(the LanguageModel's state_dict, the run's hyperparameters) from a checkpoint of any strategy."""
    checkpoint = full_checkpoint(path)
    state = {k[len(PREFIX):]: v.float() if v.is_floating_point() else v
             for k, v in checkpoint["state_dict"].items() if k.startswith(PREFIX)}
    return state, checkpoint["hyper_parameters"]

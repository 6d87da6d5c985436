"""AdamW parameter groups: which tensors are decayed, and by how much."""

from torch import nn

from lm.training.schedule import OptimConfig


def is_decayed(name: str, param) -> bool:
    """Matrices decay; norms, biases, gates and per-head vectors (ndim < 2), embeddings and any tensor a mixer
    marks with ``no_weight_decay = True`` (e.g. Mesa's Lambda, Mamba2's A_log) do not."""
    return param.ndim >= 2 and "embed" not in name and not getattr(param, "no_weight_decay", False)


def decay_groups(model: nn.Module) -> dict[str, str]:
    """Each parameter's AdamW group by name: its `decay_group` marker (attention's "qk", "vo"), else "decay" or
    "no_decay" (`is_decayed`). Take this from the model before FSDP2 shards it: `fully_shard` replaces every
    parameter with a new DTensor one, which carries none of the mixers' markers; the names stay."""
    return {name: getattr(p, "decay_group", None) or ("decay" if is_decayed(name, p) else "no_decay")
            for name, p in model.named_parameters()}


def param_groups(model: nn.Module, cfg: OptimConfig, groups: dict[str, str] | None = None) -> list[dict]:
    """Groups for torch.optim.AdamW: decayed matrices, attention q/k and v/out matrices (their own decay when
    configured: weight decay drives the rank of W_Q^T W_K and W_O W_V down; the mixers mark them with
    lm.mixers.layers.decay_group), and the undecayed rest. `groups`: `decay_groups` of the unsharded model (default:
    read from `model` now)."""
    groups = decay_groups(model) if groups is None else groups
    decay = {"decay": cfg.weight_decay, "no_decay": 0.0,
             "qk": cfg.weight_decay if cfg.qk_weight_decay is None else cfg.qk_weight_decay,
             "vo": cfg.weight_decay if cfg.vo_weight_decay is None else cfg.vo_weight_decay}
    params = {key: [] for key in decay}
    for name, param in model.named_parameters():
        if param.requires_grad:
            params[groups[name]].append(param)
    return [{"name": key, "params": ps, "weight_decay": decay[key]} for key, ps in params.items() if ps]

"""AdamW parameter groups: which tensors are decayed, and by how much."""

from torch import nn

from lm.mixers.attention import Attention
from lm.schedule import OptimConfig


def is_decayed(name: str, param) -> bool:
    """Matrices decay; norms, biases, gates and per-head vectors (ndim < 2), embeddings and any tensor a mixer
    marks with ``no_weight_decay = True`` (e.g. Mesa's Lambda, Mamba2's A_log) do not."""
    return param.ndim >= 2 and "embed" not in name and not getattr(param, "no_weight_decay", False)


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Groups for torch.optim.AdamW: decayed matrices, attention q/k and v/out matrices (their own decay when
    configured: weight decay drives the rank of W_Q^T W_K and W_O W_V down), and the undecayed rest."""
    special = {}
    for module in model.modules():
        if isinstance(module, Attention):
            special.update({id(module.q_proj.weight): "qk", id(module.k_proj.weight): "qk",
                            id(module.v_proj.weight): "vo", id(module.out_proj.weight): "vo"})
    decay = {"decay": cfg.weight_decay, "no_decay": 0.0,
             "qk": cfg.weight_decay if cfg.qk_weight_decay is None else cfg.qk_weight_decay,
             "vo": cfg.weight_decay if cfg.vo_weight_decay is None else cfg.vo_weight_decay}
    groups = {key: [] for key in decay}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        key = special.get(id(param)) or ("decay" if is_decayed(name, param) else "no_decay")
        groups[key].append(param)
    return [{"name": key, "params": params, "weight_decay": decay[key]} for key, params in groups.items() if params]

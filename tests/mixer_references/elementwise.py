"""The small pieces several references share, written out once: activations, norms and one step of a short causal
depthwise convolution (the mixers' `lm.mixers.layers.ShortConv`, from its definition)."""

import torch


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(x, torch.zeros_like(x))


def logsigmoid(x: torch.Tensor) -> torch.Tensor:
    return -softplus(-x)


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """x / ||x|| over the last axis (F.normalize's floor of 1e-12 on the norm)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True)).clamp_min(1e-12)


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def conv_step(past: torch.Tensor, x_t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One output of a causal depthwise conv, y_t = sum_j weight[:, 0, j] * x_{t - (S - 1 - j)} (+ bias), through SiLU
    with `activation`; past [B, S - 1, C] holds the inputs before x_t [B, C], oldest first. Returns (y_t, new past)."""
    window = torch.cat([past, x_t[:, None]], dim=1)  # [B, S, C], oldest first
    y = (window * weight[:, 0, :].T).sum(1)
    y = y if bias is None else y + bias
    return (silu(y) if activation else y), window[:, 1:]


def short_conv_projections(mixer, x_t: torch.Tensor, state: dict, names: str = "qkv") -> list[torch.Tensor]:
    """Each of `names`'s projection of x_t [B, D] (`mixer.{name}_proj`), through its causal conv and SiLU
    (`mixer.{name}_conv`, its past inputs in state[name], updated) when the mixer has convs (options.conv_size)."""
    out = []
    for name in names:
        u = x_t @ getattr(mixer, f"{name}_proj").weight.T
        if mixer.options.conv_size:
            u, state[name] = conv_step(state[name], u, getattr(mixer, f"{name}_conv").weight)
        out.append(u)
    return out


def cleared(state: dict, reset_t: torch.Tensor | None) -> dict:
    """A state of per-row tensors [B, ...] with the rows where reset_t [B] is True set to zero (a document starts)."""
    if reset_t is None:
        return state
    keep = (~reset_t).to(next(iter(state.values())).dtype)
    return {name: value * keep.view(-1, *[1] * (value.dim() - 1)) for name, value in state.items()}

"""Small building blocks shared by the recurrent mixers: a short causal convolution that carries its state,
a gated RMSNorm, and the initialisations of decay time steps."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    """Depthwise causal 1-D convolution over time (width `size`, no bias) with an optional SiLU; size 0 is none at
    all (the identity, no activation either: the seed papers' minimal block).

    State: the last size - 1 inputs [B, size - 1, channels], so a sequence can be fed in pieces (None for size 0).
    Parameters: channels * size.
    """

    def __init__(self, channels: int, size: int = 4, activation: bool = True):
        super().__init__()
        if size < 0:
            raise ValueError(f"conv_size must be 0 (none) or more, got {size}")
        self.size, self.activation = size, activation
        self.weight = nn.Parameter(torch.empty(channels, 1, size)) if size else None
        if size:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None):
        if self.weight is None:
            return x, None
        if state is None:
            state = x.new_zeros(x.shape[0], self.size - 1, x.shape[2])
        padded = torch.cat([state, x], dim=1)  # [B, size - 1 + T, C]
        y = F.conv1d(padded.transpose(1, 2), self.weight, groups=self.weight.shape[0]).transpose(1, 2)
        return (F.silu(y) if self.activation else y), padded[:, padded.shape[1] - (self.size - 1):]


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim of x, times silu(gate): y = norm(x) * w * silu(gate) (fla's FusedRMSNormGated).
    With `gate_first`, Mamba2's order: norm(x * silu(gate)) * w. With `normalize=False` the norm is left out,
    x * w * silu(gate), which keeps the scale of x (a mixer's `output_norm: false`). Parameters: dim."""

    def __init__(self, dim: int, eps: float = 1e-6, gate_first: bool = False, normalize: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.gate_first, self.normalize = eps, gate_first, normalize

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if not self.normalize:
            return x * self.weight * F.silu(gate)
        if self.gate_first:
            return F.rms_norm(x * F.silu(gate), (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps) * F.silu(gate)


class Gain(nn.Module):
    """x * w per channel: an RMSNorm's weight without the norm (a mixer's `output_norm: false`). Parameters: dim."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def init_dt_bias(dt_bias: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
    """Mamba's init: softplus(dt_bias) log-uniform in [dt_min, dt_max], so the decays start spread in time."""
    with torch.no_grad():
        dt = torch.exp(torch.rand_like(dt_bias) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus


def no_weight_decay(*params: nn.Parameter) -> None:
    """Mark parameters that AdamW must not decay (decay rates, skips, norms' gains)."""
    for p in params:
        p.no_weight_decay = True


def residual_output(linear: nn.Linear) -> nn.Linear:
    """Mark a projection that writes into the residual stream: the model initialises it with std / sqrt(2 n_layers)
    (GPT-2), whatever the mixer names it."""
    linear.weight.residual_output = True
    return linear


def decay_group(group: str, *params: nn.Parameter) -> None:
    """Put parameters in their own AdamW group (optim.qk_weight_decay, optim.vo_weight_decay: attention's query/key
    and value/output matrices, whose products weight decay drives to low rank)."""
    for p in params:
        p.decay_group = group

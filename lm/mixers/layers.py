"""Small building blocks shared by the recurrent mixers: a short causal convolution that carries its state,
a gated RMSNorm, and the initialisations of decay time steps."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    """Depthwise causal 1-D convolution over time (width `size`, with a bias if `bias`) with an optional SiLU; size 0
    is none at all (the identity, no activation either: the seed papers' minimal block).

    The weight starts as nn.Conv1d's (Kaiming uniform), or normal with `init_std` if given; the bias at zero.
    State: the last size - 1 inputs [B, size - 1, channels], so a sequence can be fed in pieces (None for size 0).
    With `reset` [B, T] bool, no output reaches back across a reset to an input of an earlier document (nor into the
    state), so packed documents are convolved apart; the bias is added once per output (it is no input).
    Parameters: channels * size (+ channels with the bias).
    """

    def __init__(self, channels: int, size: int = 4, activation: bool = True, bias: bool = False,
                 init_std: float | None = None):
        super().__init__()
        if size < 0:
            raise ValueError(f"conv_size must be 0 (none) or more, got {size}")
        self.size, self.activation = size, activation
        self.weight = nn.Parameter(torch.empty(channels, 1, size)) if size else None
        self.bias = nn.Parameter(torch.zeros(channels)) if size and bias else None
        if size:
            if init_std is None:
                nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            else:
                nn.init.normal_(self.weight, std=init_std)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, reset: torch.Tensor | None = None):
        if self.weight is None:
            return x, None
        if state is None:
            state = x.new_zeros(x.shape[0], self.size - 1, x.shape[2])
        padded = torch.cat([state, x], dim=1)  # [B, size - 1 + T, C]
        new_state = padded[:, padded.shape[1] - (self.size - 1):]
        if reset is None:
            y = F.conv1d(padded.transpose(1, 2), self.weight, self.bias, groups=self.weight.shape[0]).transpose(1, 2)
        else:
            y, new_state = self._within_documents(padded, reset), self._state_after(new_state, reset)
            y = y if self.bias is None else y + self.bias
        return (F.silu(y) if self.activation else y), new_state

    def _within_documents(self, padded: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
        """The convolution with tap d (the input d steps back) dropped wherever a reset lies in (t - d, t]: a sum over
        the `size` taps (a few elementwise products; the convolution itself cannot mask per output)."""
        T = reset.shape[1]
        since = steps_since_reset(reset)[..., None]  # [B, T, 1]
        y = 0
        for j in range(self.size):  # conv1d's tap j multiplies padded[t + j], the input d = size - 1 - j steps back
            y = y + padded[:, j:j + T] * self.weight[:, 0, j] * (since >= self.size - 1 - j)
        return y

    def _state_after(self, state: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
        """The last size - 1 inputs, zeroed where they come before the row's last reset (an earlier document)."""
        W = self.size - 1
        since_last = steps_since_reset(reset)[:, -1:]  # [B, 1]: the last reset is T - 1 - since_last
        age = torch.arange(W - 1, -1, -1, device=reset.device)  # state entry i holds the input W - 1 - i steps back
        return state * (age <= since_last)[..., None].to(state.dtype)


def steps_since_reset(reset: torch.Tensor) -> torch.Tensor:
    """[B, T]: steps from the last reset at or before each step (0 at a reset), or a number above T where the row has
    none up to there (everything before is the same document)."""
    T = reset.shape[1]
    steps = torch.arange(T, device=reset.device).expand_as(reset)
    last = torch.where(reset, steps, torch.full_like(steps, -2 * T - 1)).cummax(dim=1).values
    return steps - last


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


def own_init(*params: nn.Parameter) -> None:
    """Mark parameters that the mixer's constructor initialises itself (gate biases with their papers' starts): the
    model's init (LanguageModel.reset_parameters) leaves them as they are, so that each such init runs once."""
    for p in params:
        p.own_init = True


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

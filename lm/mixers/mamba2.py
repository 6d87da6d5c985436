"""Mamba2 (Dao & Gu, 2024): a scalar-decay state space model, computed as gated linear attention (SSD)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.layers import GatedRMSNorm, ShortConv, init_dt_bias, no_weight_decay, residual_output
from lm.mixers.protocol import Mixer, MixerOptionError, register
from lm.ops.call import OpCall
from lm.ops.common import compute_dtype


@register("mamba2")
class Mamba2(Mixer):
    """Mamba2 mixer. One input projection gives (z, x, B, C, dt); x, B, C pass a short causal conv + SiLU;
    per head h: dt = softplus(dt_raw + dt_bias), A = -exp(A_log), and the SSD recurrence
    S_t = exp(dt A) S_{t-1} + dt B_t x_t^T, y_t = S_t^T C_t + D x_t (linear_attention with q=C, k=B, v=x,
    beta=dt, log_gamma=dt A); then norm(y * silu(z)) and the output projection.

    n_heads SSM heads; head_dim is the state size N of B and C (shared by all heads of a group); each head's
    value width is P = expand * d_model / n_heads.

    Parameters, with I = expand * d_model, G = n_groups, W = conv_size:
        d_model * (2 I + 2 G N + n_heads)    input projection
      + (I + 2 G N) * W                      conv
      + 3 n_heads                            A_log, dt_bias, D
      + I                                    norm
      + I * d_model                          output projection
    """

    @dataclass
    class Options:
        """Mamba2: SSD, a state space model with a scalar decay per head, a short conv and a gated RMSNorm.

        Attributes:
            expand (x d_model): inner width I = expand * d_model, n_heads heads of I / n_heads values each (head_dim is
                the state size)
            n_groups: groups of heads that share B and C (n_heads a multiple of it)
            conv_size (tokens): width of the short causal conv + SiLU on x, B and C; 0: none
            output_norm: an RMSNorm of y * silu(z); false: y * silu(z) times the norm's weight
            chunk_size (tokens): the chunk of the chunkwise form (training): speed and memory, the same result to
                rounding
            backend: what computes the op: auto (flash-linear-attention's kernel for CUDA bf16/fp16 where installed,
                else torch), torch or fla
        """

        expand: float = 2.0
        n_groups: int = 1
        conv_size: int = 4
        output_norm: bool = True
        chunk_size: int = 64
        backend: str = "auto"

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        o = self.options
        inner = int(round(o.expand * d_model))
        if inner % n_heads or n_heads % o.n_groups:
            raise MixerOptionError(f"expand * d_model ({inner}) must divide into n_heads ({n_heads}) and n_heads "
                                   f"into n_groups ({o.n_groups})")
        self.state_size, self.n_groups, self.inner = head_dim, o.n_groups, inner
        self.chunk_size, self.backend = o.chunk_size, o.backend
        bc = 2 * o.n_groups * head_dim
        self.in_proj = nn.Linear(d_model, 2 * inner + bc + n_heads, bias=False)
        self.conv = ShortConv(inner + bc, o.conv_size)
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.D = nn.Parameter(torch.empty(n_heads))
        self.norm = GatedRMSNorm(inner, gate_first=True, normalize=o.output_norm)
        self.out_proj = residual_output(nn.Linear(inner, d_model, bias=False))
        no_weight_decay(self.A_log, self.dt_bias, self.D)
        self.reset_mixer_parameters()

    def reset_mixer_parameters(self):
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(1, 16)))
            self.D.fill_(1.0)
        init_dt_bias(self.dt_bias)

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None) -> OpCall:
        """SSD as linear attention on (c, b, x, log gamma = dt A, beta = dt); z and x kept for the output."""
        B, T, _ = x.shape
        H, N, G = self.n_heads, self.state_size, self.n_groups
        z, xbc, dt = self.in_proj(x).split([self.inner, self.inner + 2 * G * N, H], dim=-1)
        xbc, conv_state = self.conv(xbc, state.get("conv"), reset)
        xs, b, c = xbc.split([self.inner, G * N, G * N], dim=-1)
        xs = xs.view(B, T, H, -1)
        # Groups share B and C across their heads.
        b = b.view(B, T, G, 1, N).expand(B, T, G, H // G, N).reshape(B, T, H, N)
        c = c.view(B, T, G, 1, N).expand(B, T, G, H // G, N).reshape(B, T, H, N)
        dt = F.softplus(dt.to(compute_dtype(x)) + self.dt_bias.to(compute_dtype(x)))  # [B, T, H], decay math in fp32
        log_gamma = -torch.exp(self.A_log.to(compute_dtype(x))) * dt
        return OpCall("linear_attention", (c, b, xs, log_gamma, dt, 1.0),
                      {"chunk_size": self.chunk_size, "backend": self.backend}, state={"conv": conv_state},
                      keep={"x": xs, "z": z})

    def op_output(self, x: torch.Tensor, out: torch.Tensor, call: OpCall) -> torch.Tensor:
        """y + D x, then norm(y * silu(z)) and the output projection."""
        B, T, _ = x.shape
        y = out + self.D.to(out.dtype)[:, None] * call.keep["x"]
        return self.out_proj(self.norm(y.reshape(B, T, self.inner), call.keep["z"]))

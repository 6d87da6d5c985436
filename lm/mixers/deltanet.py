"""DeltaNet and Gated DeltaNet (Yang et al., 2024): a fast-weight memory written with the delta rule."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.layers import GatedRMSNorm, ShortConv, init_dt_bias, no_weight_decay, residual_output
from lm.mixers.protocol import Mixer, OpCall, register
from lm.ops import delta_rule, delta_rule_recurrent
from lm.ops.common import compute_dtype, effective_chunk_size
from lm.ops.flops import delta_rule_op_flops, delta_rule_op_train_flops, padding_factor
from lm.ops.state_transfer import carry_delta_rule, delta_rule_transfer


@register("deltanet")
class DeltaNet(Mixer):
    """DeltaNet mixer (flash-linear-attention's layer). q, k, v projections, each through a short causal conv +
    SiLU; q and k L2-normalised per head; beta = sigmoid(W_beta x) per head; the delta rule
    S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t / sqrt(K); a per-head RMSNorm times
    silu(W_g x) (output gate); the output projection. conv_size 0, qk_norm false and output_norm false leave out
    the convs, the L2 normalisation and the RMSNorm (the gate stays).

    Key size K = head_dim, value size V = expand_v * head_dim per head.

    Parameters, with HK = n_heads * K, HV = n_heads * V, W = conv_size:
        d_model * (2 HK + 2 HV + n_heads)     q, k, v, gate, beta projections
      + (2 HK + HV) * W                       convs
      + V                                     output norm
      + HV * d_model                          output projection
    """

    @dataclass
    class Options:
        expand_v: float = 1.0
        conv_size: int = 4
        qk_norm: bool = True
        output_norm: bool = True
        chunk_size: int = 64
        backend: str = "auto"

    gated = False

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        o = self.options
        self.key_dim, self.value_dim = head_dim, int(round(o.expand_v * head_dim))
        self.chunk_size, self.backend = o.chunk_size, o.backend
        hk, hv = n_heads * self.key_dim, n_heads * self.value_dim
        self.q_proj = nn.Linear(d_model, hk, bias=False)
        self.k_proj = nn.Linear(d_model, hk, bias=False)
        self.v_proj = nn.Linear(d_model, hv, bias=False)
        self.g_proj = nn.Linear(d_model, hv, bias=False)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        self.q_conv, self.k_conv = ShortConv(hk, o.conv_size), ShortConv(hk, o.conv_size)
        self.v_conv = ShortConv(hv, o.conv_size)
        self.norm = GatedRMSNorm(self.value_dim, normalize=o.output_norm)
        self.out_proj = residual_output(nn.Linear(hv, d_model, bias=False))
        no_weight_decay(self.b_proj.weight)
        if self.gated:  # Gated DeltaNet's decay: alpha = exp(-exp(A_log) * softplus(a + dt_bias))
            self.a_proj = nn.Linear(d_model, n_heads, bias=False)
            self.A_log = nn.Parameter(torch.empty(n_heads))
            self.dt_bias = nn.Parameter(torch.empty(n_heads))
            no_weight_decay(self.A_log, self.dt_bias, self.a_proj.weight)
            self.reset_mixer_parameters()

    def reset_mixer_parameters(self):
        if self.gated:
            with torch.no_grad():
                self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(1, 16)))
            init_dt_bias(self.dt_bias)

    def log_alpha(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.gated:
            return None
        dtype = compute_dtype(x)
        return -torch.exp(self.A_log.to(dtype)) * F.softplus(self.a_proj(x).to(dtype) + self.dt_bias.to(dtype))

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None):
        """(q, k, v, beta) for the op, and the convs' new states (a dict)."""
        B, T, _ = x.shape
        q, q_state = self.q_conv(self.q_proj(x), state.get("q_conv"), reset)
        k, k_state = self.k_conv(self.k_proj(x), state.get("k_conv"), reset)
        v, v_state = self.v_conv(self.v_proj(x), state.get("v_conv"), reset)
        q, k = q.view(B, T, self.n_heads, self.key_dim), k.view(B, T, self.n_heads, self.key_dim)
        if self.options.qk_norm:
            # In their own dtype: CUDA autocast runs `norm` in float32, which would make q and k float32 and send
            # "auto" to the torch code instead of fla's bf16 kernels (as on the lent H200, docs/performance.md).
            q, k = F.normalize(q, dim=-1).to(q.dtype), F.normalize(k, dim=-1).to(k.dtype)
        v = v.view(B, T, self.n_heads, self.value_dim)
        beta = torch.sigmoid(self.b_proj(x).to(compute_dtype(x)))
        return q, k, v, beta, {"q_conv": q_state, "k_conv": k_state, "v_conv": v_state}

    def forward(self, x: torch.Tensor, state: dict | None = None, reset: torch.Tensor | None = None):
        B, T, _ = x.shape
        state = state or {}
        q, k, v, beta, new_state = self.op_inputs(x, state, reset)
        recurrent = T == 1 and "memory" in state
        op = delta_rule_recurrent if recurrent else delta_rule
        kwargs = {} if recurrent else {"chunk_size": self.chunk_size, "backend": self.backend}
        o, new_state["memory"] = op(q, k, v, beta, self.log_alpha(x), self.key_dim ** -0.5,
                                    initial_state=state.get("memory"), reset=reset, **kwargs)
        o = self.norm(o, self.g_proj(x).view(B, T, self.n_heads, self.value_dim))
        return self.out_proj(o.reshape(B, T, -1)), new_state

    carried = "memory"

    def piece_transfer(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None):
        q, k, v, beta, _ = self.op_inputs(x, state, reset)
        return delta_rule_transfer(q, k, v, beta, self.log_alpha(x), self.key_dim ** -0.5, reset=reset,
                                   chunk_size=self.chunk_size, backend=self.backend)

    carry = staticmethod(carry_delta_rule)

    @classmethod
    def op_flops_per_token(cls, d_model, n_heads, head_dim, seq_len, training, **options) -> float:
        """The delta rule with K = head_dim, V = expand_v * head_dim (lm.ops.flops)."""
        o = cls.check_options(options)
        chunk = effective_chunk_size(o.chunk_size, seq_len)
        v = int(round(o.expand_v * head_dim))
        if training:
            per_head = delta_rule_op_train_flops(chunk, head_dim, v, math.ceil(seq_len / chunk))
        else:
            per_head = delta_rule_op_flops(chunk, head_dim, v)
        return n_heads * padding_factor(seq_len, chunk) * per_head

    @torch.no_grad()
    def bench_op(self, batch: int, T: int) -> OpCall:
        randn = lambda *dims: torch.randn(batch, T, self.n_heads, *dims)  # [B, T, H, *]
        K, V = self.key_dim, self.value_dim
        q, k = F.normalize(randn(K), dim=-1), F.normalize(randn(K), dim=-1)  # the mixer L2-normalises both
        log_alpha = -torch.exp(self.A_log) * F.softplus(randn() + self.dt_bias) if self.gated else None
        args = [q, k, randn(V), torch.sigmoid(randn()), log_alpha, K**-0.5]
        return OpCall("delta_rule", delta_rule, delta_rule_recurrent, args, (batch, T, self.n_heads, V))


@register("gated_deltanet")
class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet: DeltaNet with a per-head decay, S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    alpha_t = exp(-exp(A_log) * softplus(W_a x_t + dt_bias)); value size expand_v * head_dim (the paper's 2).

    Parameters: DeltaNet's, plus d_model * n_heads (W_a) + 2 n_heads (A_log, dt_bias).
    """

    @dataclass
    class Options(DeltaNet.Options):
        expand_v: float = 2.0

    gated = True
    paper_heads = 0.5  # keys of d/2 and values of d, as its paper: half the heads of 128, expand_v 2

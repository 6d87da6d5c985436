"""DeltaNet and Gated DeltaNet (Yang et al., 2024): a fast-weight memory written with the delta rule."""

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.layers import GatedRMSNorm, ShortConv, init_dt_bias, no_weight_decay
from lm.ops import delta_rule, delta_rule_recurrent
from lm.ops.common import compute_dtype


class DeltaNet(nn.Module):
    """DeltaNet mixer (flash-linear-attention's layer). q, k, v projections, each through a short causal conv +
    SiLU; q and k L2-normalised per head; beta = sigmoid(W_beta x) per head; the delta rule
    S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t / sqrt(K); a per-head RMSNorm times
    silu(W_g x) (output gate); the output projection.

    Key size K = head_dim, value size V = expand_v * head_dim per head.

    Parameters, with HK = n_heads * K, HV = n_heads * V, W = conv_size:
        d_model * (2 HK + 2 HV + n_heads)     q, k, v, gate, beta projections
      + (2 HK + HV) * W                       convs
      + V                                     output norm
      + HV * d_model                          output projection
    """

    gated = False

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, expand_v: float = 1.0,
                 conv_size: int = 4, chunk_size: int = 64, backend: str = "auto"):
        super().__init__()
        self.n_heads, self.key_dim, self.value_dim = n_heads, head_dim, int(round(expand_v * head_dim))
        self.chunk_size, self.backend = chunk_size, backend
        hk, hv = n_heads * self.key_dim, n_heads * self.value_dim
        self.q_proj = nn.Linear(d_model, hk, bias=False)
        self.k_proj = nn.Linear(d_model, hk, bias=False)
        self.v_proj = nn.Linear(d_model, hv, bias=False)
        self.g_proj = nn.Linear(d_model, hv, bias=False)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        self.q_conv, self.k_conv = ShortConv(hk, conv_size), ShortConv(hk, conv_size)
        self.v_conv = ShortConv(hv, conv_size)
        self.norm = GatedRMSNorm(self.value_dim)
        self.out_proj = nn.Linear(hv, d_model, bias=False)
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

    def forward(self, x: torch.Tensor, state: dict | None = None):
        B, T, _ = x.shape
        state = state or {}
        q, q_state = self.q_conv(self.q_proj(x), state.get("q_conv"))
        k, k_state = self.k_conv(self.k_proj(x), state.get("k_conv"))
        v, v_state = self.v_conv(self.v_proj(x), state.get("v_conv"))
        q = F.normalize(q.view(B, T, self.n_heads, self.key_dim), dim=-1)
        k = F.normalize(k.view(B, T, self.n_heads, self.key_dim), dim=-1)
        v = v.view(B, T, self.n_heads, self.value_dim)
        beta = torch.sigmoid(self.b_proj(x).to(compute_dtype(x)))
        recurrent = T == 1 and "memory" in state
        op = delta_rule_recurrent if recurrent else delta_rule
        kwargs = {} if recurrent else {"chunk_size": self.chunk_size, "backend": self.backend}
        o, memory = op(q, k, v, beta, self.log_alpha(x), self.key_dim ** -0.5, initial_state=state.get("memory"),
                       **kwargs)
        o = self.norm(o, self.g_proj(x).view(B, T, self.n_heads, self.value_dim))
        new_state = {"q_conv": q_state, "k_conv": k_state, "v_conv": v_state, "memory": memory}
        return self.out_proj(o.reshape(B, T, -1)), new_state

    @classmethod
    def param_count(cls, d_model, n_heads, head_dim, expand_v=1.0, conv_size=4, **_) -> int:
        v = int(round(expand_v * head_dim))
        hk, hv = n_heads * head_dim, n_heads * v
        gates = (d_model * n_heads + 2 * n_heads) if cls.gated else 0
        return d_model * (2 * hk + 2 * hv + n_heads) + (2 * hk + hv) * conv_size + v + hv * d_model + gates


class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet: DeltaNet with a per-head decay, S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    alpha_t = exp(-exp(A_log) * softplus(W_a x_t + dt_bias)); value size expand_v * head_dim (the paper's 2).

    Parameters: DeltaNet's, plus d_model * n_heads (W_a) + 2 n_heads (A_log, dt_bias).
    """

    gated = True

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, expand_v: float = 2.0,
                 conv_size: int = 4, chunk_size: int = 64, backend: str = "auto"):
        super().__init__(d_model, n_heads, head_dim, layer_idx, expand_v, conv_size, chunk_size, backend)

    @classmethod
    def param_count(cls, d_model, n_heads, head_dim, expand_v=2.0, conv_size=4, **_) -> int:
        return super().param_count(d_model, n_heads, head_dim, expand_v, conv_size)

"""Kimi Delta Attention (KDA; Kimi Linear, arXiv 2510.26692): the gated delta rule with one decay per key channel,
and GDN-2's channel-wise erase and write gates as an option."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.deltanet import beta_in_range, check_beta_range, init_decay
from lm.mixers.layers import Gain, ShortConv, no_weight_decay, residual_output
from lm.mixers.protocol import Mixer, register
from lm.ops.call import OpCall
from lm.ops.common import compute_dtype


@register("kda")
class KDA(Mixer):
    """KDA mixer (Kimi Linear's layer, as flash-linear-attention ships it). q, k, v projections, each through a short
    causal conv + SiLU; q and k L2-normalised per head; a decay per key channel from a low-rank gate,
    log alpha_t = -exp(A_log) softplus(W_up W_down x_t + dt_bias) (rank V, A_log per head, dt_bias per channel);
    beta_t = low + (high - low) sigmoid(W_b x_t) per head (beta_range, as DeltaNet's); per head

        S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(K)

    (the decay first, then the erase, which reads the decayed state); the output RMSNorm per head times
    sigmoid(W_up' W_down' x_t + b) (a low-rank output gate of rank V, with a bias); the output projection.

    channel_gates: GDN-2's gates in place of beta, an erase gate b_t in R^K and a write gate w_t in R^V per head,
        S_t = (I - k_t (b_t * k_t)^T) Diag(alpha_t) S_{t-1} + k_t (w_t * v_t)^T,
    b_t = low + (high - low) sigmoid(W_b x_t) (beta_range, as fla's allow_neg_eigval doubles b only) and
    w_t = sigmoid(W_w x_t); b = w = beta is KDA. conv_size 0, qk_norm false and output_norm false leave out the convs,
    the L2 normalisation and the RMSNorm (the gate stays).

    Key size K = head_dim, value size V = expand_v * head_dim per head; Kimi's heads of 128 with K = V (paper_heads
    1, expand_v 1).

    Parameters, with HK = n_heads * K, HV = n_heads * V, W = conv_size, G = HK + HV with channel gates, else n_heads:
        d_model * (2 HK + HV + G)           q, k, v, beta (or erase and write) projections
      + (2 HK + HV) * W                     convs
      + d_model * V + V * HK + HK + n_heads  low-rank decay, dt_bias, A_log
      + d_model * V + V * HV + HV            low-rank output gate (with its bias)
      + V + HV * d_model                    output norm, output projection
    """

    @dataclass
    class Options:
        """Kimi Delta Attention: the delta rule with a decay per key channel; GDN-2's erase and write gates optional.

        Attributes:
            expand_v (x head_dim): value size per head, V = expand_v * head_dim (the keys have head_dim); also the rank
                of the low-rank decay and output gates
            conv_size (tokens): width of the short causal convs + SiLU on q, k and v; 0: none
            qk_norm: L2-normalise q and k per head
            output_norm: a per-head RMSNorm on the op's output, before the output gate; false: the norm's weight alone
            channel_gates: GDN-2's gates in place of beta: an erase gate per key channel, a write gate per value channel
            beta_range: [low, high] of beta (of the erase gate with channel_gates) = low + (high - low) sigmoid(W_b x);
                [0, 2] lets the eigenvalue 1 - beta reach -1 (negative eigenvalues: parity, state tracking); [0, 1]:
                KDA's
            chunk_size (tokens): the chunk of the chunkwise form (training): speed and memory, the same result to
                rounding
            sub_chunk (tokens): the secondary chunk of the per-channel decay within a chunk: speed (the chunk is rounded
                up to a multiple of it)
            backend: what computes the op: auto (flash-linear-attention's chunk_kda for CUDA bf16/fp16 where installed
                and it passes its self-check, else torch), torch or fla
        """

        expand_v: float = 1.0
        conv_size: int = 4
        qk_norm: bool = True
        output_norm: bool = True
        channel_gates: bool = False
        beta_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
        chunk_size: int = 32  # 32 and 1: the fastest on a CPU, at the ladder's widths and at 256 (docs/performance.md)
        sub_chunk: int = 1
        backend: str = "auto"

    @classmethod
    def check_options(cls, options: dict):
        o = super().check_options(options)
        check_beta_range(cls.name, o.beta_range)
        return o

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        o = self.options
        self.key_dim, self.value_dim = head_dim, int(round(o.expand_v * head_dim))
        K, V = self.key_dim, self.value_dim
        hk, hv = n_heads * K, n_heads * V
        self.q_proj = nn.Linear(d_model, hk, bias=False)
        self.k_proj = nn.Linear(d_model, hk, bias=False)
        self.v_proj = nn.Linear(d_model, hv, bias=False)
        self.q_conv, self.k_conv = ShortConv(hk, o.conv_size), ShortConv(hk, o.conv_size)
        self.v_conv = ShortConv(hv, o.conv_size)
        self.b_proj = nn.Linear(d_model, hk if o.channel_gates else n_heads, bias=False)
        self.w_proj = nn.Linear(d_model, hv, bias=False) if o.channel_gates else None
        self.decay_down, self.decay_up = nn.Linear(d_model, V, bias=False), nn.Linear(V, hk, bias=False)
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(hk))
        self.gate_down, self.gate_up = nn.Linear(d_model, V, bias=False), nn.Linear(V, hv)
        self.norm = Gain(V)
        self.out_proj = residual_output(nn.Linear(hv, d_model, bias=False))
        no_weight_decay(self.A_log, self.dt_bias, self.b_proj.weight, *([self.w_proj.weight] if self.w_proj else []))
        self.reset_mixer_parameters()

    def reset_mixer_parameters(self):
        init_decay(self.A_log, self.dt_bias)

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None) -> OpCall:
        """KDA on (q, k, v, log alpha per key channel, beta) with scale 1 / sqrt(K); with channel gates, the erase and
        write gates instead of beta."""
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.key_dim, self.value_dim
        q, q_state = self.q_conv(self.q_proj(x), state.get("q_conv"), reset)
        k, k_state = self.k_conv(self.k_proj(x), state.get("k_conv"), reset)
        v, v_state = self.v_conv(self.v_proj(x), state.get("v_conv"), reset)
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)
        if self.options.qk_norm:  # in their own dtype, as DeltaNet's (fla's bf16 kernels under autocast)
            q, k = F.normalize(q, dim=-1).to(q.dtype), F.normalize(k, dim=-1).to(k.dtype)
        dtype = compute_dtype(x)
        decay = F.softplus(self.decay_up(self.decay_down(x)).to(dtype) + self.dt_bias.to(dtype)).view(B, T, H, K)
        log_alpha = -torch.exp(self.A_log.to(dtype))[:, None] * decay
        beta = beta_in_range(self.b_proj(x), self.options.beta_range)
        options = {"chunk_size": self.options.chunk_size, "sub_chunk": self.options.sub_chunk,
                   "backend": self.options.backend}
        if self.w_proj is not None:
            write = torch.sigmoid(self.w_proj(x).to(dtype)).view(B, T, H, V)
            options |= {"erase": beta.view(B, T, H, K), "write": write}
            beta = None
        return OpCall("kda", (q, k, v, log_alpha, beta, K ** -0.5), options,
                      state={"q_conv": q_state, "k_conv": k_state, "v_conv": v_state})

    def op_output(self, x: torch.Tensor, out: torch.Tensor, call: OpCall) -> torch.Tensor:
        """RMSNorm(o) * w * sigmoid(output gate) per head (o * w * sigmoid(gate) without the norm), projected."""
        B, T, _ = x.shape
        o = F.rms_norm(out, (self.value_dim,), eps=1e-5) if self.options.output_norm else out
        gate = self.gate_up(self.gate_down(x)).view(B, T, self.n_heads, self.value_dim)
        return self.out_proj((self.norm(o) * torch.sigmoid(gate)).reshape(B, T, -1))

"""Gated Linear Attention (Yang et al., ICML 2024): linear attention with a data-dependent decay per key dimension."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.layers import GatedRMSNorm, ShortConv, residual_output
from lm.mixers.protocol import Mixer, register
from lm.ops.call import OpCall
from lm.ops.common import compute_dtype


@register("gla")
class GLA(Mixer):
    """GLA mixer (flash-linear-attention's layer). q, k, v projections; a low-rank decay per key dimension,
    log alpha_t = logsigmoid(W_2 W_1 x_t + b) / tau (rank 16, temperature tau = 16, so decays start near
    sigmoid(0)^(1/16) = 0.96 per step); S_t = diag(alpha_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t / sqrt(K)
    (lm.ops.linear_attention with a [B, T, H, K] log-decay); a per-head RMSNorm times silu(W_r x) (the paper's
    swish output gate over a per-head norm); the output projection.

    Key size K = head_dim, value size V = expand_v * head_dim per head. The paper's keys of d/2 and values of d are
    half the attention model's heads of 128 with expand_v 2 (`paper_heads`).

    conv_size > 0 adds fla's optional short causal conv + SiLU on q, k and v (`use_short_conv`); the paper's GLA, the
    default, has none. With it, one layer can bind a token to the one before it, as MQAR needs (docs/mqar.md).

    Parameters, with HK = n_heads * K, HV = n_heads * V, R = gate_rank:
        d_model * (2 HK + 2 HV)     q, k, v, output gate
      + d_model * R + R * HK + HK   low-rank decay (second factor with a bias)
      + V                           output norm
      + HV * d_model                output projection
      + (2 HK + HV) * W             convs (if any, W = conv_size)

    State: {"memory": S [B, H, K, V], and the convs' last W - 1 inputs if any}.
    """

    @dataclass
    class Options:
        """GLA: linear attention with a low-rank data-dependent decay per key dimension and a SiLU output gate.

        Attributes:
            expand_v (x head_dim): value size per head, V = expand_v * head_dim (the keys have head_dim)
            gate_rank: rank of the decay's low-rank projection W_2 W_1
            gate_temperature: tau in log alpha_t = logsigmoid(W_2 W_1 x_t + b) / tau; larger: decays nearer 1 at init
            conv_size (tokens): width of short causal convs + SiLU on q, k and v (fla's use_short_conv); 0: none, GLA's
            output_norm: a per-head RMSNorm on the op's output, before the output gate; false: the norm's weight alone
            chunk_size (tokens): the chunk of the chunkwise form (training): speed and memory, the same result to
                rounding
            sub_chunk (tokens): the secondary chunk of the per-key decay within a chunk: speed
                (docs/performance-history.md)
            backend: what computes the op: auto (flash-linear-attention's kernel for CUDA bf16/fp16 where installed,
                else torch), torch or fla
        """

        expand_v: float = 2.0
        gate_rank: int = 16
        gate_temperature: float = 16.0
        conv_size: int = 0
        output_norm: bool = True
        chunk_size: int = 64
        sub_chunk: int = 8
        backend: str = "auto"

    paper_heads = 0.5

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        o = self.options
        self.key_dim, self.value_dim = head_dim, int(round(o.expand_v * head_dim))
        self.temperature, self.chunk_size, self.sub_chunk, self.backend = (o.gate_temperature, o.chunk_size,
                                                                           o.sub_chunk, o.backend)
        hk, hv = n_heads * self.key_dim, n_heads * self.value_dim
        self.q_proj = nn.Linear(d_model, hk, bias=False)
        self.k_proj = nn.Linear(d_model, hk, bias=False)
        self.v_proj = nn.Linear(d_model, hv, bias=False)
        self.g_proj = nn.Linear(d_model, hv, bias=False)
        self.decay_down = nn.Linear(d_model, o.gate_rank, bias=False)
        self.decay_up = nn.Linear(o.gate_rank, hk)
        self.convs = nn.ModuleDict({name: ShortConv(width, o.conv_size) for name, width in
                                    (("q_conv", hk), ("k_conv", hk), ("v_conv", hv))} if o.conv_size > 0 else {})
        self.norm = GatedRMSNorm(self.value_dim, normalize=o.output_norm)
        self.out_proj = residual_output(nn.Linear(hv, d_model, bias=False))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, K] in fp32: logsigmoid(W_2 W_1 x + b) / temperature."""
        B, T, _ = x.shape
        logits = self.decay_up(self.decay_down(x)).to(compute_dtype(x))
        return (F.logsigmoid(logits) / self.temperature).view(B, T, self.n_heads, self.key_dim)

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None) -> OpCall:
        """Linear attention on (q, k, v) with a per-key log decay, scale 1 / sqrt(K)."""
        B, T, _ = x.shape
        tails = {}
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.convs:
            q, tails["q_conv"] = self.convs["q_conv"](q, state.get("q_conv"), reset)
            k, tails["k_conv"] = self.convs["k_conv"](k, state.get("k_conv"), reset)
            v, tails["v_conv"] = self.convs["v_conv"](v, state.get("v_conv"), reset)
        q, k = q.view(B, T, self.n_heads, self.key_dim), k.view(B, T, self.n_heads, self.key_dim)
        args = (q, k, v.view(B, T, self.n_heads, self.value_dim), self.log_decay(x), None, self.key_dim ** -0.5)
        options = {"chunk_size": self.chunk_size, "sub_chunk": self.sub_chunk, "backend": self.backend}
        return OpCall("linear_attention", args, options, state=tails)

    def op_output(self, x: torch.Tensor, out: torch.Tensor, call: OpCall) -> torch.Tensor:
        B, T, _ = x.shape
        o = self.norm(out, self.g_proj(x).view(B, T, self.n_heads, self.value_dim))
        return self.out_proj(o.reshape(B, T, -1))

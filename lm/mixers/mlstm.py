"""mLSTM as in xLSTM 7B (Beck et al., 2025): a matrix memory with exponential input and sigmoid forget gates."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.layers import ShortConv, no_weight_decay, own_init, residual_output
from lm.mixers.protocol import Mixer, MixerOptionError, register
from lm.ops.call import OpCall
from lm.ops.common import compute_dtype


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


@register("mlstm")
class MLSTM(Mixer):
    """xLSTM 7B mLSTM mixer. q, k (total width qk_dim_factor * d_model) and v (v_dim_factor * d_model) split
    into n_heads; input and forget gate pre-activations per head, soft-capped (gate_soft_cap); the mLSTM cell
    (lm.ops.mlstm); a per-head RMSNorm; an output gate sigmoid(W_o x); the output projection.

    head_dim is not used: as in xLSTM 7B, the head sizes follow d_model and the dim factors.

    conv_size > 0 adds the short causal convolution + SiLU of the first xLSTM paper's mLSTM block (Beck et al.,
    2024): q and k are computed from conv(x), v and the gates from x. xLSTM 7B dropped it (conv_size 0, the
    default). With it, one layer can bind a token to the one before it, as MQAR needs (docs/mqar.md).

    Parameters, with QK = qk_dim_factor * d_model, V = v_dim_factor * d_model, W = conv_size:
        d_model * (2 QK + V)           q, k, v
      + 2 (d_model * n_heads + n_heads) input and forget gates (with biases)
      + d_model * V                    output gate
      + V                              norm
      + V * d_model                    output projection
      + d_model * W                    conv (if any)

    State: {"cell": the mLSTM's (C, n, m), "conv": the conv's last W - 1 inputs (if any)}.
    """

    @dataclass
    class Options:
        """mLSTM as in xLSTM 7B: a matrix memory with exponential input and sigmoid forget gates, an output gate.

        Attributes:
            qk_dim_factor (x d_model): width of q and of k over all heads
            v_dim_factor (x d_model): width of v over all heads
            gate_soft_cap: the gates' pre-activations soft-capped to (-cap, cap) by cap tanh(x / cap); null: no cap
            eps: added to the cell's normaliser, h_t = C_t^T q_t / (max(|n_t^T q_t|, exp(-m_t)) + eps)
            conv_size (tokens): width of a short causal conv + SiLU before q and k (the first xLSTM paper's block); 0:
                none, xLSTM 7B's
            output_norm: a per-head RMSNorm on the cell's output; false: the norm's weight alone
            chunk_size (tokens): the chunk of the chunkwise form (training): speed and memory, the same result to
                rounding
            backend: what computes the cell: auto (torch: mlstm_kernels' gradients did not match on the one GPU it ran
                on), torch or mlstm_kernels (CUDA)
        """

        qk_dim_factor: float = 0.5
        v_dim_factor: float = 1.0
        gate_soft_cap: float | None = 15.0
        eps: float = 1e-6
        conv_size: int = 0
        output_norm: bool = True
        chunk_size: int = 64
        backend: str = "auto"

    def __init__(self, d_model: int, n_heads: int, head_dim: int = 0, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        o = self.options
        qk, v = int(round(o.qk_dim_factor * d_model)), int(round(o.v_dim_factor * d_model))
        if qk % n_heads or v % n_heads:
            raise MixerOptionError(f"q/k width {qk} and v width {v} must be multiples of n_heads {n_heads}")
        self.qk_head, self.v_head = qk // n_heads, v // n_heads
        self.gate_soft_cap, self.eps, self.chunk_size, self.backend = o.gate_soft_cap, o.eps, o.chunk_size, o.backend
        self.conv = ShortConv(d_model, o.conv_size) if o.conv_size > 0 else None
        self.q_proj = nn.Linear(d_model, qk, bias=False)
        self.k_proj = nn.Linear(d_model, qk, bias=False)
        self.v_proj = nn.Linear(d_model, v, bias=False)
        self.igate = nn.Linear(d_model, n_heads)
        self.fgate = nn.Linear(d_model, n_heads)
        self.ogate = nn.Linear(d_model, v, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(v))
        self.out_proj = residual_output(nn.Linear(v, d_model, bias=False))
        no_weight_decay(self.igate.weight, self.fgate.weight)
        own_init(self.igate.bias, self.fgate.bias)  # the model's init leaves the gate biases to this one
        self.reset_mixer_parameters()

    def reset_mixer_parameters(self):
        """xLSTM 7B: input gates start nearly shut (bias -10), forget gates open (bias 3..6 across heads)."""
        with torch.no_grad():
            self.igate.bias.fill_(-10.0)
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, self.n_heads))

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None) -> OpCall:
        """The mLSTM cell on (q, k, v, input and forget gate pre-activations)."""
        B, T, _ = x.shape
        H, tails, qk_in = self.n_heads, {}, x
        if self.conv is not None:
            qk_in, tails["conv"] = self.conv(x, state.get("conv"), reset)
        q = self.q_proj(qk_in).view(B, T, H, self.qk_head)
        k = self.k_proj(qk_in).view(B, T, H, self.qk_head)
        v = self.v_proj(x).view(B, T, H, self.v_head)
        i_pre = soft_cap(self.igate(x).to(compute_dtype(x)), self.gate_soft_cap)
        f_pre = soft_cap(self.fgate(x).to(compute_dtype(x)), self.gate_soft_cap)
        return OpCall("mlstm", (q, k, v, i_pre, f_pre),
                      {"eps": self.eps, "chunk_size": self.chunk_size, "backend": self.backend}, state=tails)

    def op_output(self, x: torch.Tensor, out: torch.Tensor, call: OpCall) -> torch.Tensor:
        """The per-head norm, the norm weight, the output gate and the output projection."""
        B, T, _ = x.shape
        if self.options.output_norm:
            out = F.rms_norm(out, (self.v_head,), eps=1e-6)
        h = out.reshape(B, T, -1) * self.norm_weight
        return self.out_proj(h * torch.sigmoid(self.ogate(x)))

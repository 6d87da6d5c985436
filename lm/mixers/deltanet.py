"""DeltaNet and Gated DeltaNet (Yang et al., 2024): a fast-weight memory written with the delta rule."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.layers import GatedRMSNorm, ShortConv, init_dt_bias, no_weight_decay, residual_output
from lm.mixers.protocol import Mixer, MixerOptionError, register
from lm.ops.call import OpCall
from lm.ops.common import compute_dtype


def check_beta_range(mixer: str, beta_range: list[float]) -> None:
    """The option beta_range of every delta-rule mixer: [low, high] with 0 <= low < high <= 2, else a one-line
    MixerOptionError."""
    if len(beta_range) != 2 or not 0 <= beta_range[0] < beta_range[1] <= 2:
        raise MixerOptionError(f"mixer {mixer!r} option 'beta_range' must be [low, high] with 0 <= low < high <= 2, "
                               f"got {beta_range!r}")


def beta_in_range(logits: torch.Tensor, beta_range: list[float]) -> torch.Tensor:
    """low + (high - low) sigmoid(logits), in the decay math's dtype: [0, 2] lets the transition's eigenvalue
    1 - beta reach -1 (parity; Grazzi et al., arXiv 2411.12537)."""
    low, high = beta_range
    return low + (high - low) * torch.sigmoid(logits.to(compute_dtype(logits)))


def init_decay(A_log: nn.Parameter, dt_bias: nn.Parameter) -> None:
    """Gated DeltaNet's decay exp(-exp(A_log) softplus(a + dt_bias)) at its start: A = exp(A_log) uniform in [1, 16]
    per head, dt_bias by Mamba's init."""
    with torch.no_grad():
        A_log.copy_(torch.log(torch.empty_like(A_log).uniform_(1, 16)))
    init_dt_bias(dt_bias)


@register("deltanet")
class DeltaNet(Mixer):
    """DeltaNet mixer (flash-linear-attention's layer). q, k, v projections, each through a short causal conv +
    SiLU; q and k L2-normalised per head; beta = low + (high - low) sigmoid(W_beta x) per head, beta_range
    [low, high] ([0, 1], the paper's; [0, 2] lets the transition's eigenvalue 1 - beta reach -1: negative eigenvalues,
    Grazzi et al., arXiv 2411.12537); the delta rule
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
        """DeltaNet: the delta rule with short convolutions, L2-normalised q and k and an output gate.

        Attributes:
            expand_v (x head_dim): value size per head, V = expand_v * head_dim (the keys have head_dim)
            conv_size (tokens): width of the short causal convs + SiLU on q, k and v; 0: none
            qk_norm: L2-normalise q and k per head
            output_norm: a per-head RMSNorm on the op's output, before the output gate; false: the norm's weight alone
            beta_range: [low, high] of beta = low + (high - low) sigmoid(W_beta x), the write strength; [0, 2] lets the
                eigenvalue 1 - beta reach -1 (negative eigenvalues: parity, state tracking); [0, 1]: DeltaNet's
            chunk_size (tokens): the chunk of the chunkwise form (training): speed and memory, the same result to
                rounding
            backend: what computes the op: auto (flash-linear-attention's kernel for CUDA bf16/fp16 where installed,
                else torch), torch or fla
        """

        expand_v: float = 1.0
        conv_size: int = 4
        qk_norm: bool = True
        output_norm: bool = True
        beta_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
        chunk_size: int = 64
        backend: str = "auto"

    @classmethod
    def check_options(cls, options: dict):
        o = super().check_options(options)
        check_beta_range(cls.name, o.beta_range)
        return o

    gated = False
    op = "delta_rule"  # Gated DeltaProduct's "delta_product" takes the same inputs, with `steps` rows per token

    def steps(self) -> int:
        """Delta-rule steps per token, each with its own k, v and beta (Gated DeltaProduct's Householder steps)."""
        return 1

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        o = self.options
        self.key_dim, self.value_dim = head_dim, int(round(o.expand_v * head_dim))
        self.chunk_size, self.backend = o.chunk_size, o.backend
        hk, hv, n = n_heads * self.key_dim, n_heads * self.value_dim, self.steps()
        self.q_proj = nn.Linear(d_model, hk, bias=False)
        self.k_proj = nn.Linear(d_model, n * hk, bias=False)
        self.v_proj = nn.Linear(d_model, n * hv, bias=False)
        self.g_proj = nn.Linear(d_model, hv, bias=False)
        self.b_proj = nn.Linear(d_model, n * n_heads, bias=False)
        self.q_conv, self.k_conv = ShortConv(hk, o.conv_size), ShortConv(n * hk, o.conv_size)
        self.v_conv = ShortConv(n * hv, o.conv_size)
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
            init_decay(self.A_log, self.dt_bias)

    def log_alpha(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.gated:
            return None
        dtype = compute_dtype(x)
        return -torch.exp(self.A_log.to(dtype)) * F.softplus(self.a_proj(x).to(dtype) + self.dt_bias.to(dtype))

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None) -> OpCall:
        """The delta rule on (q, k, v, beta, log alpha) with scale 1 / sqrt(K); with n steps a token, k, v and beta
        have T * n rows, token t's steps at rows t * n .. t * n + n - 1 (fla's layout)."""
        B, T, _ = x.shape
        H, rows = self.n_heads, T * self.steps()
        q, q_state = self.q_conv(self.q_proj(x), state.get("q_conv"), reset)
        k, k_state = self.k_conv(self.k_proj(x), state.get("k_conv"), reset)
        v, v_state = self.v_conv(self.v_proj(x), state.get("v_conv"), reset)
        q, k = q.view(B, T, H, self.key_dim), k.reshape(B, rows, H, self.key_dim)
        if self.options.qk_norm:
            # In their own dtype: CUDA autocast runs `norm` in float32, which would make q and k float32 and send
            # "auto" to the torch code instead of fla's bf16 kernels (as on the lent H200, docs/performance.md).
            q, k = F.normalize(q, dim=-1).to(q.dtype), F.normalize(k, dim=-1).to(k.dtype)
        v = v.reshape(B, rows, H, self.value_dim)
        beta = beta_in_range(self.b_proj(x), self.options.beta_range).reshape(B, rows, H)
        return OpCall(self.op, (q, k, v, beta, self.log_alpha(x), self.key_dim ** -0.5),
                      {"chunk_size": self.chunk_size, "backend": self.backend},
                      state={"q_conv": q_state, "k_conv": k_state, "v_conv": v_state})

    def op_output(self, x: torch.Tensor, out: torch.Tensor, call: OpCall) -> torch.Tensor:
        B, T, _ = x.shape
        o = self.norm(out, self.g_proj(x).view(B, T, self.n_heads, self.value_dim))
        return self.out_proj(o.reshape(B, T, -1))


@register("gated_deltanet")
class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet: DeltaNet with a per-head decay, S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    alpha_t = exp(-exp(A_log) * softplus(W_a x_t + dt_bias)); value size expand_v * head_dim (the paper's 2).

    Parameters: DeltaNet's, plus d_model * n_heads (W_a) + 2 n_heads (A_log, dt_bias).
    """

    @dataclass
    class Options(DeltaNet.Options):
        """Gated DeltaNet: DeltaNet with a decay per head; values twice the keys' size (expand_v 2, its paper's)."""

        expand_v: float = 2.0

    gated = True
    paper_heads = 0.5  # keys of d/2 and values of d, as its paper: half the heads of 128, expand_v 2

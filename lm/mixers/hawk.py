"""Hawk (De et al., 2024, "Griffin"): the recurrent block with the Real-Gated Linear Recurrent Unit (RG-LRU)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.layers import ShortConv, no_weight_decay, residual_output
from lm.mixers.protocol import Mixer, register
from lm.ops.call import OpCall
from lm.ops.common import compute_dtype


class BlockDiagonalLinear(nn.Module):
    """x W + b with W block-diagonal: `blocks` independent [width / blocks]^2 matrices (Griffin's RG-LRU gates)."""

    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.blocks = blocks
        self.weight = nn.Parameter(torch.empty(blocks, width // blocks, width // blocks))
        self.bias = nn.Parameter(torch.zeros(width))
        nn.init.normal_(self.weight, std=(width // blocks) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("...hi,hij->...hj", x.unflatten(-1, (self.blocks, -1)), self.weight)
        return y.flatten(-2) + self.bias


@register("hawk")
class Hawk(Mixer):
    """Griffin's recurrent block. Two branches of width W = expand * d_model (rounded to a multiple of n_heads):
    gelu(W_gate x), and W_x x -> a short causal conv (width conv_size, with a bias) -> RG-LRU; their product -> W_out.
    RG-LRU, with block-diagonal gates (n_heads blocks), as Griffin's released code (recurrentgemma) computes it:
        r_t = sigmoid(W_a u_t + b_a),  i_t = sigmoid(W_i u_t + b_i),  log a_t = -c r_t softplus(Lambda), c = 8,
        h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * u_t)        (lm.ops.diagonal_scan)
    Lambda starts as recurrentgemma's rnn_param_init(min_rad=0.9, max_rad=0.999): the base decay
    a0 = exp(-softplus(Lambda)) with a0^2 uniform in [0.81, 0.998], so at init (r near 0.5) the decays a0^(c r) span
    about 0.66 to 0.996. The conv's weight starts normal with std sqrt(0.01 / conv_size), its bias at zero (as
    recurrentgemma's Conv1D). head_dim is not used.

    The Griffin paper's text reads differently from its code: it writes a_t = sigma(Lambda)^(c r_t) (the base decay
    sigmoid(Lambda) = exp(-softplus(-Lambda)), where the code has exp(-softplus(Lambda))) and starts Lambda with a^c
    uniform in [0.9, 0.999] (the code draws a0^2 uniformly); lm follows the code.

    Griffin's code also skips the sqrt(1 - a^2) factor on a document's first token (there h_{t-1} = 0); here every
    token is normalised alike, so that a packed row and a sequence split in pieces compute the same (a piece's first
    token is no document's first, and a rule keyed to it would tie the output to where the sequence was cut).

    Parameters, with W the width, H = n_heads, S = conv_size:
        2 d_model * W          the two input branches
      + W * S + W              conv and its bias (none when S = 0)
      + 2 (W^2 / H + W)        the gates (block-diagonal, with biases)
      + W                      Lambda
      + W * d_model            output projection
    """

    @dataclass
    class Options:
        """Hawk: Griffin's recurrent block, a gated branch times a short conv and the RG-LRU.

        Attributes:
            expand (x d_model): width of the recurrent branch, W = expand * d_model rounded to a multiple of n_heads
                (Griffin's 4/3)
            conv_size (tokens): width of the short causal conv (with a bias) before the RG-LRU; 0: none
            c: the constant in the RG-LRU's decay, log a_t = -c r_t softplus(Lambda) (Griffin's 8)
            chunk_size (tokens): the chunk of the chunkwise scan (training): speed and memory, the same result to
                rounding
            backend: what computes the scan: auto (flash-linear-attention's fused_recurrent_hgrn for CUDA bf16/fp16
                where installed, else torch), torch or fla
        """

        expand: float = 4 / 3
        conv_size: int = 4
        c: float = 8.0
        chunk_size: int = 64
        backend: str = "auto"

    @staticmethod
    def width(d_model: int, n_heads: int, expand: float) -> int:
        return n_heads * max(1, round(expand * d_model / n_heads))

    def __init__(self, d_model: int, n_heads: int, head_dim: int = 0, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        o = self.options
        W = self.rnn_width = self.width(d_model, n_heads, o.expand)
        self.c, self.chunk_size, self.backend = o.c, o.chunk_size, o.backend
        self.gate_proj = nn.Linear(d_model, W, bias=False)
        self.x_proj = nn.Linear(d_model, W, bias=False)
        self.conv = ShortConv(W, o.conv_size, activation=False, bias=True,
                              init_std=(0.01 / o.conv_size) ** 0.5 if o.conv_size else None)
        self.a_gate = BlockDiagonalLinear(W, n_heads)
        self.i_gate = BlockDiagonalLinear(W, n_heads)
        self.a_param = nn.Parameter(torch.empty(W))  # Lambda
        self.out_proj = residual_output(nn.Linear(W, d_model, bias=False))
        no_weight_decay(self.a_param)
        self.reset_mixer_parameters()

    def reset_mixer_parameters(self):
        """recurrentgemma's rnn_param_init: a0^2 uniform in [0.81, 0.998] for the base decay
        a0 = exp(-softplus(Lambda)), i.e. Lambda = softplus^-1(-log a0); the gates' blocks at 1 / sqrt(fan-in)."""
        with torch.no_grad():
            log_a0 = 0.5 * torch.log(torch.empty_like(self.a_param).uniform_(0.9**2, 0.999**2))
            self.a_param.copy_(torch.log(torch.expm1(-log_a0)))
            for gate in (self.a_gate, self.i_gate):
                nn.init.normal_(gate.weight, std=gate.weight.shape[-1] ** -0.5)
                gate.bias.zero_()

    def scan_inputs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, log a) [B, T, W] in fp32 for the scan h_t = a_t h_{t-1} + x_t, from the conv's output u."""
        dtype = compute_dtype(u)
        r = torch.sigmoid(self.a_gate(u).to(dtype))
        i = torch.sigmoid(self.i_gate(u).to(dtype))
        log_a = -self.c * r * F.softplus(self.a_param.to(dtype))
        # sqrt(1 - a^2) = sqrt(-expm1(2 log a)), exact for a near 1 where 1 - a^2 would cancel.
        return torch.sqrt(-torch.expm1(2 * log_a)) * (i * u.to(dtype)), log_a

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None) -> OpCall:
        """The RG-LRU as a diagonal scan on (x, log a) from the conv's output."""
        u, conv_state = self.conv(self.x_proj(x), state.get("conv"), reset)
        xs, log_a = self.scan_inputs(u)
        return OpCall("diagonal_scan", (xs, log_a), {"chunk_size": self.chunk_size, "backend": self.backend},
                      state={"conv": conv_state})

    def op_output(self, x: torch.Tensor, out: torch.Tensor, call: OpCall) -> torch.Tensor:
        return self.out_proj(F.gelu(self.gate_proj(x), approximate="tanh") * out.to(x.dtype))

"""Hawk (De et al., 2024, "Griffin"): the recurrent block with the RG-LRU, as Griffin's released code
(recurrentgemma) computes it, token by token in float64:

    u_t = conv(W_x x_t) (a causal depthwise conv with a bias, no activation; none with conv_size 0)
    r_t = sigmoid(W_a u_t + b_a),  i_t = sigmoid(W_i u_t + b_i)         (block-diagonal W_a, W_i: one block per head)
    log a_t = -c r_t softplus(Lambda),  a_t = exp(log a_t)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t)
    y_t = W_out (gelu_tanh(W_gate x_t) h_t)

A reset clears h and the conv's past inputs. Every token, a document's first too, is normalised by sqrt(1 - a_t^2)
(lm's choice, where Griffin's code skips it on a document's first token: lm.mixers.hawk).
"""

import math

import torch

from mixer_references import reference
from mixer_references.elementwise import conv_step


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def block_diagonal(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """u [B, W] through `blocks` independent matrices weight [blocks, W / blocks, W / blocks], plus the bias."""
    blocks, n, _ = weight.shape
    out = [u[:, j * n:(j + 1) * n] @ weight[j] for j in range(blocks)]
    return torch.cat(out, dim=-1) + bias


@reference("hawk", variants=[{"chunk_size": 4}, {"chunk_size": 4, "conv_size": 0}, {"chunk_size": 4, "c": 3.0}])
def forward(mixer, x, state, reset):
    B, T, _ = x.shape
    S, c = mixer.options.conv_size, mixer.options.c
    W = mixer.x_proj.weight.shape[0]
    conv_w = mixer.conv.weight  # [W, 1, S]: tap j multiplies the input S - 1 - j steps back
    conv_b = mixer.conv.bias
    if state is None:
        state = {"past": x.new_zeros(B, max(S - 1, 0), W), "h": x.new_zeros(B, W)}
    past, h = state["past"], state["h"]
    ys = []
    for t in range(T):
        if reset is not None:
            keep = (~reset[:, t]).to(x.dtype)[:, None]
            past, h = past * keep[:, :, None], h * keep
        xt = x[:, t]
        u_in = xt @ mixer.x_proj.weight.T
        if S:
            u, past = conv_step(past, u_in, conv_w, conv_b, activation=False)
        else:
            u = u_in
        r = torch.sigmoid(block_diagonal(u, mixer.a_gate.weight, mixer.a_gate.bias))
        i = torch.sigmoid(block_diagonal(u, mixer.i_gate.weight, mixer.i_gate.bias))
        softplus = torch.log1p(torch.exp(mixer.a_param))
        a = torch.exp(-c * r * softplus)
        h = a * h + torch.sqrt(1 - a**2) * (i * u)
        gate = gelu_tanh(xt @ mixer.gate_proj.weight.T)
        ys.append((gate * h) @ mixer.out_proj.weight.T)
    return torch.stack(ys, dim=1), {"past": past, "h": h}

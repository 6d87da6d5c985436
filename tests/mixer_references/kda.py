"""Kimi Delta Attention (Kimi Linear, arXiv 2510.26692) and GDN-2's channel gates, token by token in float64 from the
mixer's own parameters.

q, k, v = SiLU(causal depthwise conv(W x)) each (no conv, no SiLU with conv_size 0); q, k L2-normalised per head
(qk_norm); a decay per key channel alpha_t = exp(-exp(A_log) softplus(W_up W_down x_t + dt_bias)); beta_t = low +
(high - low) sigmoid(W_b x_t) per head (beta_range); per head, the decay first and then the delta rule's erase:

    S' = Diag(alpha_t) S_{t-1},    S_t = S' - beta_t k_t (k_t^T S') + beta_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(K).

With channel gates (GDN-2) the erase gate b_t = low + (high - low) sigmoid(W_b x_t) in R^K and the write gate
w_t = sigmoid(W_w x_t) in R^V replace beta: S_t = S' - k_t ((b_t * k_t)^T S') + k_t (w_t * v_t)^T.
Then rmsnorm(o_t) * w * sigmoid(W_up' W_down' x_t + b) per head (eps 1e-5; o_t * w * ... with output_norm false) and
the output projection. A reset clears S and the convs' past inputs.
"""

import math

import torch

from . import reference
from .deltanet import _zero_state  # the same state: S and the q, k, v convs' past inputs
from .elementwise import cleared, l2_normalise, rms_normalise, short_conv_projections, softplus

VARIANTS = [{"chunk_size": 8, "sub_chunk": 4}, {"chunk_size": 4, "sub_chunk": 2, "channel_gates": True},
            {"chunk_size": 4, "sub_chunk": 2, "beta_range": [0.0, 2.0]},
            {"chunk_size": 4, "sub_chunk": 2, "channel_gates": True, "beta_range": [0.0, 2.0]},
            {"chunk_size": 4, "sub_chunk": 4, "conv_size": 0, "qk_norm": False, "output_norm": False},
            {"chunk_size": 4, "sub_chunk": 2, "expand_v": 2.0}]


@reference("kda", variants=VARIANTS)
def forward(mixer, x, state, reset):
    B, T, _ = x.shape
    H, K, V = mixer.n_heads, mixer.key_dim, mixer.value_dim
    o = mixer.options
    low, high = o.beta_range
    state = dict(state) if state is not None else _zero_state(mixer, x)
    outputs = []
    for t in range(T):
        x_t = x[:, t]
        state = cleared(state, None if reset is None else reset[:, t])
        qkv = short_conv_projections(mixer, x_t, state)
        q, k, v = qkv[0].view(B, H, K), qkv[1].view(B, H, K), qkv[2].view(B, H, V)
        if o.qk_norm:
            q, k = l2_normalise(q), l2_normalise(k)
        rate = softplus((x_t @ mixer.decay_down.weight.T) @ mixer.decay_up.weight.T + mixer.dt_bias).view(B, H, K)
        alpha = torch.exp(-torch.exp(mixer.A_log)[:, None] * rate)  # [B, H, K]
        gate = low + (high - low) * torch.sigmoid(x_t @ mixer.b_proj.weight.T)
        if o.channel_gates:
            erase, write = gate.view(B, H, K), torch.sigmoid(x_t @ mixer.w_proj.weight.T).view(B, H, V)
        else:
            erase, write = gate[..., None], gate[..., None]  # beta per head, both gates
        S = alpha[..., None] * state["S"]  # Diag(alpha_t) S_{t-1}: the decay before the erase
        read = ((erase * k)[..., :, None] * S).sum(-2)  # (b * k)^T S'  [B, H, V]
        S = S - k[..., :, None] * read[..., None, :] + k[..., :, None] * (write * v)[..., None, :]
        state["S"] = S
        out = (S * q[..., None]).sum(-2) / math.sqrt(K)
        if o.output_norm:
            out = rms_normalise(out, 1e-5)
        g = ((x_t @ mixer.gate_down.weight.T) @ mixer.gate_up.weight.T + mixer.gate_up.bias).view(B, H, V)
        out = out * mixer.norm.weight * torch.sigmoid(g)
        outputs.append(out.reshape(B, H * V) @ mixer.out_proj.weight.T)
    return torch.stack(outputs, 1), state

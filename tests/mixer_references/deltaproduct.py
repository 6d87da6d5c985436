"""Gated DeltaProduct (arXiv 2502.10297), token by token in float64 from the mixer's own parameters.

q = SiLU(conv(W_q x)); the k and v projections (and their convs) hold n_h slices, step j's at [j H K, (j + 1) H K)
(and likewise for v), k_{t,j} and v_{t,j}; beta_{t,j} = low + (high - low) sigmoid(W_b x_t)[j H + h]; q and each k_{t,j}
L2-normalised per head (qk_norm); alpha_t = exp(-exp(A_log) softplus(W_a x_t + dt_bias)) once per token; per head

    S = alpha_t S_{t-1};  for j = 1 .. n_h:  S = S - beta_{t,j} k_{t,j} (k_{t,j}^T S) + beta_{t,j} k_{t,j} v_{t,j}^T;
    o_t = S^T q_t / sqrt(K);

then rmsnorm(o_t) * w * silu(W_g x_t) (eps 1e-6; without the norm with output_norm false) and the output projection.
"""

import math

import torch

from . import reference
from .elementwise import cleared, l2_normalise, rms_normalise, short_conv_projections, silu, softplus

CHUNK = {"chunk_size": 4}


@reference("gated_deltaproduct", variants=[CHUNK, {**CHUNK, "householder_steps": 1},
                                           {**CHUNK, "householder_steps": 3, "chunk_size": 5},
                                           {**CHUNK, "beta_range": [0.0, 1.0]},
                                           {**CHUNK, "conv_size": 0, "output_norm": False}])
def forward(mixer, x, state, reset):
    B, T, _ = x.shape
    H, K, V = mixer.n_heads, mixer.key_dim, mixer.value_dim
    o = mixer.options
    n, (low, high) = o.householder_steps, o.beta_range
    if state is None:
        state = {"S": x.new_zeros(B, H, K, V)}
        if o.conv_size:
            W = o.conv_size - 1
            state.update(q=x.new_zeros(B, W, H * K), k=x.new_zeros(B, W, n * H * K), v=x.new_zeros(B, W, n * H * V))
    state = dict(state)
    outputs = []
    for t in range(T):
        x_t = x[:, t]
        state = cleared(state, None if reset is None else reset[:, t])
        qkv = short_conv_projections(mixer, x_t, state)
        q, k, v = qkv[0].view(B, H, K), qkv[1].view(B, n, H, K), qkv[2].view(B, n, H, V)
        if o.qk_norm:
            q, k = l2_normalise(q), l2_normalise(k)
        beta = (low + (high - low) * torch.sigmoid(x_t @ mixer.b_proj.weight.T)).view(B, n, H)
        alpha = torch.exp(-torch.exp(mixer.A_log) * softplus(x_t @ mixer.a_proj.weight.T + mixer.dt_bias))
        S = alpha[..., None, None] * state["S"]  # the gate once, before the token's steps
        for j in range(n):
            k_j, b_j = k[:, j], beta[:, j, :, None, None]
            kS = (k_j[..., :, None] * S).sum(-2)  # k^T S  [B, H, V]
            S = S - b_j * k_j[..., :, None] * kS[..., None, :] + b_j * k_j[..., :, None] * v[:, j, :, None, :]
        state["S"] = S
        out = (S * q[..., None]).sum(-2) / math.sqrt(K)
        if o.output_norm:
            out = rms_normalise(out, 1e-6)
        out = out * mixer.norm.weight * silu((x_t @ mixer.g_proj.weight.T).view(B, H, V))
        outputs.append(out.reshape(B, H * V) @ mixer.out_proj.weight.T)
    return torch.stack(outputs, 1), state

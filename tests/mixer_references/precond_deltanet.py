"""Preconditioned Gated DeltaNet (Tumma, Loo, Rus; arXiv 2604.21100), token by token in float64 from the mixer's own
parameters.

q, k, v, beta_t, alpha_t as Gated DeltaNet's (tests/mixer_references/deltanet.py); the preconditioner's gates
beta^A_t = sigmoid(W_b^A x_t), alpha^A_t = exp(-exp(A_log^A) softplus(W_a^A x_t + dt_bias^A)) and center c per head;
per head and key channel

    A_t = alpha^A_t A_{t-1} + beta^A_t k_t^2,    r = log(A_t + eps) - c,    M_t = squash^(-r / (1 + |r|));

then the delta rule's step along the preconditioned key (the error read with k, written along M * k):

    S' = alpha_t S_{t-1},    S_t = S' + beta_t (M_t * k_t) (v_t - S'^T k_t)^T,    o_t = S_t^T q_t / sqrt(K);

then rmsnorm(o_t) * w * silu(W_g x_t) and the output projection. A reset clears S, A and the convs' past inputs.
"""

import math

import torch

from . import reference
from .elementwise import cleared, l2_normalise, rms_normalise, short_conv_projections, silu, softplus

CHUNK = {"chunk_size": 4}


@reference("precond_gated_deltanet", variants=[CHUNK, {**CHUNK, "beta_range": [0.0, 2.0], "squash": 2.0},
                                               {**CHUNK, "expand_v": 1, "conv_size": 0, "output_norm": False}])
def forward(mixer, x, state, reset):
    B, T, _ = x.shape
    H, K, V = mixer.n_heads, mixer.key_dim, mixer.value_dim
    o = mixer.options
    low, high = o.beta_range
    if state is None:
        state = {"S": x.new_zeros(B, H, K, V), "A": x.new_zeros(B, H, K)}
        if o.conv_size:
            W = o.conv_size - 1
            state.update(q=x.new_zeros(B, W, H * K), k=x.new_zeros(B, W, H * K), v=x.new_zeros(B, W, H * V))
    state = dict(state)
    outputs = []
    for t in range(T):
        x_t = x[:, t]
        state = cleared(state, None if reset is None else reset[:, t])
        qkv = short_conv_projections(mixer, x_t, state)
        q, k, v = qkv[0].view(B, H, K), qkv[1].view(B, H, K), qkv[2].view(B, H, V)
        if o.qk_norm:
            q, k = l2_normalise(q), l2_normalise(k)
        beta = low + (high - low) * torch.sigmoid(x_t @ mixer.b_proj.weight.T)
        alpha = torch.exp(-torch.exp(mixer.A_log) * softplus(x_t @ mixer.a_proj.weight.T + mixer.dt_bias))
        beta_a = torch.sigmoid(x_t @ mixer.precond_b_proj.weight.T)
        alpha_a = torch.exp(-torch.exp(mixer.precond_A_log)
                            * softplus(x_t @ mixer.precond_a_proj.weight.T + mixer.precond_dt_bias))
        A = alpha_a[..., None] * state["A"] + beta_a[..., None] * k * k  # [B, H, K]
        r = torch.log(A + o.squash_eps) - mixer.precond_center[:, None]
        M = torch.exp(-math.log(o.squash) * r / (1 + r.abs()))
        S = alpha[..., None, None] * state["S"]
        error = v - (k[..., :, None] * S).sum(-2)  # v - S'^T k  [B, H, V]
        S = S + beta[..., None, None] * (M * k)[..., :, None] * error[..., None, :]
        state["S"], state["A"] = S, A
        out = (S * q[..., None]).sum(-2) / math.sqrt(K)
        if o.output_norm:
            out = rms_normalise(out, 1e-6)
        out = out * mixer.norm.weight * silu((x_t @ mixer.g_proj.weight.T).view(B, H, V))
        outputs.append(out.reshape(B, H * V) @ mixer.out_proj.weight.T)
    return torch.stack(outputs, 1), state

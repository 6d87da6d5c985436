"""DeltaNet and Gated DeltaNet (Yang et al., 2024), token by token in float64 from the mixer's own parameters.

q, k, v = SiLU(causal depthwise conv(W x)) each (no conv, no SiLU with conv_size 0); q, k L2-normalised per head
(qk_norm); beta_t = low + (high - low) sigmoid(W_b x_t) for beta_range [low, high]; Gated DeltaNet's decay
alpha_t = exp(-exp(A_log) softplus(W_a x_t + dt_bias)) (alpha = 1 for DeltaNet); per head

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(K);

then the gated RMSNorm rmsnorm(o_t) * w * silu(W_g x_t) (o_t * w * silu(W_g x_t) with output_norm false) and the
output projection.
"""

import math

import torch

from . import reference
from .elementwise import cleared, conv_step, l2_normalise, rms_normalise, silu, softplus

CHUNK = {"chunk_size": 4}


def _conv(conv, state, name, x_t):
    """conv + SiLU of x_t, the conv's past inputs in state[name] (updated); x_t itself without a conv."""
    if conv is None or conv.weight is None:
        return x_t
    y, state[name] = conv_step(state[name], x_t, conv.weight)
    return y


def _zero_state(mixer, x):
    B, H, K, V = x.shape[0], mixer.n_heads, mixer.key_dim, mixer.value_dim
    W = mixer.options.conv_size
    state = {"S": x.new_zeros(B, H, K, V)}
    if W:
        state.update(q=x.new_zeros(B, W - 1, H * K), k=x.new_zeros(B, W - 1, H * K), v=x.new_zeros(B, W - 1, H * V))
    return state


def forward(mixer, x, state, reset):
    B, T, _ = x.shape
    H, K, V = mixer.n_heads, mixer.key_dim, mixer.value_dim
    state = dict(state) if state is not None else _zero_state(mixer, x)
    outputs = []
    for t in range(T):
        x_t = x[:, t]
        state = cleared(state, None if reset is None else reset[:, t])
        q, k, v = (_conv(getattr(mixer, f"{n}_conv"), state, n, x_t @ getattr(mixer, f"{n}_proj").weight.T)
                   for n in "qkv")
        q, k, v = q.view(B, H, K), k.view(B, H, K), v.view(B, H, V)
        if mixer.options.qk_norm:
            q, k = l2_normalise(q), l2_normalise(k)
        low, high = mixer.options.beta_range
        beta = (low + (high - low) * torch.sigmoid(x_t @ mixer.b_proj.weight.T))[..., None, None]  # [B, H, 1, 1]
        S = state["S"]
        if mixer.gated:
            alpha = torch.exp(-torch.exp(mixer.A_log) * softplus(x_t @ mixer.a_proj.weight.T + mixer.dt_bias))
            S = alpha[..., None, None] * S
        kS = (k[..., :, None] * S).sum(-2)  # k^T S  [B, H, V]
        S = S - beta * k[..., :, None] * kS[..., None, :] + beta * k[..., :, None] * v[..., None, :]
        state["S"] = S
        o = (S * q[..., None]).sum(-2) / math.sqrt(K)  # [B, H, V]
        if mixer.options.output_norm:
            o = rms_normalise(o, 1e-6)
        o = o * mixer.norm.weight * silu((x_t @ mixer.g_proj.weight.T).view(B, H, V))
        outputs.append(o.reshape(B, H * V) @ mixer.out_proj.weight.T)
    return torch.stack(outputs, 1), state


reference("deltanet", variants=[CHUNK, {**CHUNK, "conv_size": 0}, {**CHUNK, "qk_norm": False},
                                {**CHUNK, "output_norm": False}, {**CHUNK, "expand_v": 2},
                                {**CHUNK, "beta_range": [0.0, 2.0]}])(forward)
reference("gated_deltanet", variants=[CHUNK, {**CHUNK, "expand_v": 1}, {**CHUNK, "conv_size": 0},
                                      {**CHUNK, "qk_norm": False, "output_norm": False},
                                      {**CHUNK, "beta_range": [0.0, 2.0]}])(forward)

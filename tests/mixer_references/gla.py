"""Gated Linear Attention (Yang et al., ICML 2024), token by token in float64:

    q_t, k_t, v_t = W_Q x_t, W_K x_t, W_V x_t         (each through a causal depthwise conv + SiLU with conv_size > 0)
    alpha_t = sigmoid(W_2 W_1 x_t + b)^(1 / tau)      (a decay per key dimension; tau the gate temperature)
    per head: S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,  o_t = S_t^T q_t / sqrt(K)
    y_t = W_O [RMSNorm(o_t) * w * silu(W_r x_t)]      (the norm per head over V, w shared by the heads;
                                                       with output_norm false: o_t * w * silu(W_r x_t))

A reset clears S and the convs' past inputs.
"""

import torch

from mixer_references import reference
from mixer_references.elementwise import conv_step, silu


@reference("gla", variants=[{"chunk_size": 4, "sub_chunk": 2}, {"chunk_size": 4, "sub_chunk": 2, "conv_size": 4},
                            {"chunk_size": 4, "sub_chunk": 2, "output_norm": False},
                            {"chunk_size": 4, "sub_chunk": 2, "gate_temperature": 2.0}])
def forward(mixer, x, state, reset):
    Bsz, T, _ = x.shape
    o = mixer.options
    H, K = mixer.n_heads, mixer.head_dim
    V = mixer.v_proj.weight.shape[0] // H
    S = o.conv_size
    names = ("q_conv", "k_conv", "v_conv")
    if state is None:
        state = {"S": x.new_zeros(Bsz, H, K, V)}
        if S:
            state |= {n: x.new_zeros(Bsz, S - 1, w) for n, w in zip(names, (H * K, H * K, H * V))}
    state = dict(state)
    memory = state["S"]
    ys = []
    for t in range(T):
        if reset is not None:
            keep = (~reset[:, t]).to(x.dtype)
            memory = memory * keep[:, None, None, None]
            for n in names if S else ():
                state[n] = state[n] * keep[:, None, None]
        xt = x[:, t]
        qkv = [xt @ mixer.q_proj.weight.T, xt @ mixer.k_proj.weight.T, xt @ mixer.v_proj.weight.T]
        if S:
            for j, n in enumerate(names):
                qkv[j], state[n] = conv_step(state[n], qkv[j], mixer.convs[n].weight)
        q, k, v = qkv[0].view(Bsz, H, K), qkv[1].view(Bsz, H, K), qkv[2].view(Bsz, H, V)
        logits = (xt @ mixer.decay_down.weight.T) @ mixer.decay_up.weight.T + mixer.decay_up.bias
        alpha = torch.sigmoid(logits).pow(1 / o.gate_temperature).view(Bsz, H, K)
        memory = alpha[..., None] * memory + k[..., None] * v[:, :, None, :]  # [B, H, K, V]
        out = (memory * q[..., None]).sum(2) / K**0.5  # [B, H, V]
        gate = silu(xt @ mixer.g_proj.weight.T).view(Bsz, H, V)
        if o.output_norm:
            out = out / torch.sqrt((out**2).mean(-1, keepdim=True) + mixer.norm.eps)
        ys.append((out * mixer.norm.weight * gate).reshape(Bsz, H * V) @ mixer.out_proj.weight.T)
    state["S"] = memory
    return torch.stack(ys, dim=1), state

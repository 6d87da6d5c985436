"""Mamba2 (Dao & Gu, 2024, "Transformers are SSMs"): the SSD recurrence, token by token in float64:

    [z, xBC, dt_raw] = W_in x_t
    [x, B, C] = silu(conv(xBC))            (causal depthwise conv, no bias; with conv_size 0 neither conv nor SiLU)
    per head h (in group g = h // (H / G), whose B_g, C_g [N] it shares; x_h [P]):
        dt_h = softplus(dt_raw_h + dt_bias_h),  A_h = -exp(A_log_h)
        S_h = exp(dt_h A_h) S_h + dt_h B_g x_h^T         (S_h [N, P])
        y_h = S_h^T C_g + D_h x_h
    out_t = W_out norm(y * silu(z))        (gated RMSNorm over the whole inner width, weight w, gate first;
                                            with output_norm false: y * w * silu(z))

A reset clears S and the conv's past inputs.
"""

import torch

from mixer_references import reference
from mixer_references.elementwise import conv_step, silu, softplus


@reference("mamba2", variants=[{"chunk_size": 4}, {"chunk_size": 4, "n_groups": 2},
                               {"chunk_size": 4, "output_norm": False}, {"chunk_size": 4, "conv_size": 0},
                               {"chunk_size": 4, "conv_size": 3}])
def forward(mixer, x, state, reset):
    Bsz, T, _ = x.shape
    o = mixer.options
    H, N, G, inner, S = mixer.n_heads, mixer.head_dim, o.n_groups, mixer.inner, o.conv_size
    P = inner // H
    width = inner + 2 * G * N  # the conv's channels: x, B, C
    if state is None:
        state = {"past": x.new_zeros(Bsz, max(S - 1, 0), width), "S": x.new_zeros(Bsz, H, N, P)}
    past, ssm = state["past"], state["S"]
    A = -torch.exp(mixer.A_log)
    ys = []
    for t in range(T):
        if reset is not None:
            keep = (~reset[:, t]).to(x.dtype)
            past, ssm = past * keep[:, None, None], ssm * keep[:, None, None, None]
        proj = x[:, t] @ mixer.in_proj.weight.T
        z, xbc, dt_raw = proj[:, :inner], proj[:, inner:inner + width], proj[:, inner + width:]
        if S:
            xbc, past = conv_step(past, xbc, mixer.conv.weight)
        xs = xbc[:, :inner].reshape(Bsz, H, P)
        b = xbc[:, inner:inner + G * N].reshape(Bsz, G, N)
        c = xbc[:, inner + G * N:].reshape(Bsz, G, N)
        dt = softplus(dt_raw + mixer.dt_bias)  # [B, H]
        heads, new = [], []
        for h in range(H):
            g = h // (H // G)
            decay = torch.exp(dt[:, h] * A[h])[:, None, None]
            s = decay * ssm[:, h] + dt[:, h, None, None] * b[:, g, :, None] * xs[:, h, None, :]  # [B, N, P]
            new.append(s)
            heads.append((s * c[:, g, :, None]).sum(1) + mixer.D[h] * xs[:, h])  # [B, P]
        ssm = torch.stack(new, dim=1)
        y = torch.cat(heads, dim=-1)  # [B, inner]
        if o.output_norm:
            gated = y * silu(z)
            y = gated / torch.sqrt((gated**2).mean(-1, keepdim=True) + mixer.norm.eps) * mixer.norm.weight
        else:
            y = y * mixer.norm.weight * silu(z)
        ys.append(y @ mixer.out_proj.weight.T)
    return torch.stack(ys, dim=1), {"past": past, "S": ssm}

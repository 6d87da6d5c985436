"""The Mesa layer (von Oswald et al., 2025, arXiv 2506.05233), token by token in float64 from the mixer's own
parameters, with the exact solve (torch.linalg.solve) where the mixer runs conjugate gradients.

q, k = SiLU(causal depthwise conv(W x)) (v too with conv_v; no conv, no SiLU with conv_size 0), L2-normalised per
head (qk_norm); beta_t = sigmoid(W_beta x_t + b), gamma_t = sigmoid(W_gamma x_t + b) * (1 - (1 - gamma_cap) beta_t^2)
(no factor with gamma_cap None); Lambda = lam_floor + softplus(lam_raw) [H, K]; per head

    G_t = gamma_t G_{t-1} + beta_t v_t k_t^T,    H_t = gamma_t H_{t-1} + beta_t k_t k_t^T,
    o_t = G_t (H_t + diag(Lambda))^{-1} q_t;

then per head RMSNorm(o_t) * w (o_t * w with output_norm false), times silu(W_g x_t) with output_gate, and the
output projection. The mixer's 30 CG steps (train mode) are exact in float64 at K = 8 (they agree to ~1e-14), so the
default atol 1e-9 holds, tight enough that a float32 step in the forward or the adjoint solve fails.
"""

import torch

from . import reference
from .deltanet import _conv
from .elementwise import cleared, l2_normalise, rms_normalise, silu, softplus

CHUNK = {"chunk_size": 4}


def _zero_state(mixer, x):
    B, H, K, V = x.shape[0], mixer.n_heads, mixer.key_dim, mixer.value_dim
    W = mixer.options.conv_size
    state = {"G": x.new_zeros(B, H, V, K), "H": x.new_zeros(B, H, K, K)}
    if W:
        state.update(q=x.new_zeros(B, W - 1, H * K), k=x.new_zeros(B, W - 1, H * K))
        if mixer.options.conv_v:
            state["v"] = x.new_zeros(B, W - 1, H * V)
    return state


@reference("mesa", atol=1e-9, variants=[
    CHUNK,
    {**CHUNK, "output_gate": True},
    {**CHUNK, "output_gate": True, "output_norm": False},
    {**CHUNK, "output_norm": False},
    {**CHUNK, "conv_v": True},
    {**CHUNK, "expand_v": 2},
    {**CHUNK, "gamma_cap": None},
    {**CHUNK, "qk_norm": False},
    {**CHUNK, "conv_size": 0, "lam_floor": 0.5},
])
def forward(mixer, x, state, reset):
    B, T, _ = x.shape
    H, K, V = mixer.n_heads, mixer.key_dim, mixer.value_dim
    o_ = mixer.options
    state = dict(state) if state is not None else _zero_state(mixer, x)
    lam = o_.lam_floor + softplus(mixer.lam_raw)  # [H, K]
    outputs = []
    for t in range(T):
        x_t = x[:, t]
        state = cleared(state, None if reset is None else reset[:, t])
        q = _conv(mixer.q_conv, state, "q", x_t @ mixer.q_proj.weight.T).view(B, H, K)
        k = _conv(mixer.k_conv, state, "k", x_t @ mixer.k_proj.weight.T).view(B, H, K)
        v = _conv(mixer.v_conv, state, "v", x_t @ mixer.v_proj.weight.T).view(B, H, V)
        if o_.qk_norm:
            q, k = l2_normalise(q), l2_normalise(k)
        beta = torch.sigmoid(x_t @ mixer.beta_proj.weight.T + mixer.beta_proj.bias)  # [B, H]
        gamma = torch.sigmoid(x_t @ mixer.gamma_proj.weight.T + mixer.gamma_proj.bias)
        if o_.gamma_cap is not None:
            gamma = gamma * (1 - (1 - o_.gamma_cap) * beta**2)
        beta, gamma = beta[..., None, None], gamma[..., None, None]
        G = gamma * state["G"] + beta * v[..., :, None] * k[..., None, :]  # [B, H, V, K]
        Hk = gamma * state["H"] + beta * k[..., :, None] * k[..., None, :]  # [B, H, K, K]
        state.update(G=G, H=Hk)
        z = torch.linalg.solve(Hk + torch.diag_embed(lam).expand_as(Hk), q[..., None])  # [B, H, K, 1]
        o = (G @ z)[..., 0]  # [B, H, V]
        if o_.output_norm:
            o = rms_normalise(o, 1e-6)
        o = o * mixer.norm.weight
        if o_.output_gate:
            o = o * silu((x_t @ mixer.g_proj.weight.T).view(B, H, V))
        outputs.append(o.reshape(B, H * V) @ mixer.out_proj.weight.T)
    return torch.stack(outputs, 1), state

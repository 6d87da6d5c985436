"""Gated linear attention (scalar decay per head and step), the recurrence behind Mamba2's SSD, RetNet and GLA-style
mixers:

    S_t = gamma_t S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t,    gamma_t = exp(log_gamma_t)

with state S of shape [B, H, K, V]. Mamba2's SSD is this with q=C, k=B, v=x, beta=dt, log_gamma=dt*A.

`linear_attention` is the chunkwise form for training: within a chunk the outputs are a masked (decayed) attention
product, across chunks only the [K, V] state is carried. `linear_attention_recurrent` is the plain per-step loop, for
decoding. Both keep state and decay arithmetic in float32 (float64 stays float64) and return the output in the
input dtype.
"""

import torch

from lm.ops.common import (
    autocast_off,
    causal_decay,
    check_shapes,
    compute_dtype,
    effective_chunk_size,
    from_head_chunks,
    initial_state_or_zeros,
    to_head_chunks,
)
from lm.ops.fla import fla_linear_attention, use_fla


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise gated linear attention.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_gamma, beta: [B, T, H] (beta None means 1);
    initial_state: [B, H, K, V] or None (zeros). Any T works. Returns (out [B, T, H, V] in q's dtype,
    final_state [B, H, K, V] in float32, or float64 for float64 inputs).
    backend: "torch" (this code), "fla" (flash-linear-attention's chunk_simple_gla, CUDA only) or "auto"
    (fla for CUDA bf16/fp16 inputs when it imports, else torch). fla picks its own chunk size.
    """
    check_shapes(q, k, v, initial_state, log_gamma=log_gamma, beta=beta)
    if use_fla(backend, q, k, v, log_gamma, beta, initial_state, op="linear_attention"):
        return fla_linear_attention(q, k, v, log_gamma, beta, scale, initial_state)
    chunk_size = effective_chunk_size(chunk_size, q.shape[1])
    return _chunkwise(q, k, v, log_gamma, beta, scale, initial_state, chunk_size)


@autocast_off()
def _chunkwise(q, k, v, log_gamma, beta, scale, initial_state, chunk_size):
    """The chunkwise algorithm. All intra-chunk work is batched over chunks; only the state pass loops over them.

    With b_i the cumulative log-decay inside a chunk (b_i = sum of log_gamma up to and including step i) and S the
    state entering the chunk:
        o_i   = scale * (exp(b_i) q_i^T S + sum_{j<=i} exp(b_i - b_j) beta_j (q_i . k_j) v_j)
        S_new = exp(b_last) S + sum_j exp(b_last - b_j) beta_j k_j v_j^T
    The padded tail (zero keys/values, zero log-decay) neither writes to nor decays the state.
    """
    T, V, in_dtype, dtype = q.shape[1], v.shape[-1], q.dtype, compute_dtype(q)
    state = initial_state_or_zeros(initial_state, q, V, dtype)
    if beta is not None:
        # beta only scales what step j writes, so it can ride on the key: beta_j k_j v_j^T = (beta_j k_j) v_j^T.
        k = k.to(dtype) * beta.to(dtype)[..., None]
    q, k, v = (to_head_chunks(x, chunk_size, dtype) for x in (q, k, v))  # [B, H, N, C, K or V]
    b = to_head_chunks(log_gamma, chunk_size, dtype).cumsum(-1)  # [B, H, N, C]
    b_last = b[..., -1:]  # [B, H, N, 1], log-decay over the whole chunk

    # Intra-chunk: causal attention weighted by the decay between the two steps, for all chunks at once.
    scores = torch.einsum("bhnik,bhnjk->bhnij", q, k) * causal_decay(b)
    out = scores @ v

    # What each chunk adds to the state, decayed to the chunk's end (b_last - b_j <= 0: no overflow).
    k_to_end = k * (b_last - b).exp()[..., None]
    chunk_states = torch.einsum("bhnck,bhncv->bhnkv", k_to_end, v)  # [B, H, N, K, V]

    # Inter-chunk: a short sequential scan over chunks carries the state; keep the state entering every chunk.
    entering = []
    for n in range(q.shape[2]):
        entering.append(state)
        state = b_last[:, :, n, :, None].exp() * state + chunk_states[:, :, n]
    entering = torch.stack(entering, dim=2)  # [B, H, N, K, V]

    # Query part of the carried state, decayed from the chunk start to step i.
    out = out + torch.einsum("bhnck,bhnkv->bhncv", q * b.exp()[..., None], entering)
    return (scale * from_head_chunks(out, T)).to(in_dtype), state


@autocast_off()
def linear_attention_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent gated linear attention: a plain loop over t, for decoding (T=1 with a carried state) and as a
    readable statement of the recurrence. Same arguments and results as `linear_attention`."""
    check_shapes(q, k, v, initial_state, log_gamma=log_gamma, beta=beta)
    in_dtype, dtype = q.dtype, compute_dtype(q)
    q, k, v, log_gamma = (x.to(dtype) for x in (q, k, v, log_gamma))
    if beta is not None:
        k = k * beta.to(dtype)[..., None]  # beta_t k_t v_t^T = (beta_t k_t) v_t^T
    state = initial_state_or_zeros(initial_state, q, v.shape[-1], dtype)
    outs = []
    for t in range(q.shape[1]):
        gamma = log_gamma[:, t, :, None, None].exp()  # [B, H, 1, 1]
        state = gamma * state + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    out = scale * torch.stack(outs, dim=1)
    return out.to(in_dtype), state

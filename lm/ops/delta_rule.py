"""The (gated) delta rule, the recurrence behind DeltaNet and Gated DeltaNet:

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t,

alpha_t = exp(log_alpha_t) (1 when log_alpha is None: plain DeltaNet), state S of shape [B, H, K, V].

`delta_rule` is the chunkwise form for training, via the WY / UT transform of Yang et al. ("Parallelizing Linear
Transformers with the Delta Rule over Sequence Length"; "Gated Delta Networks"); `delta_rule_recurrent` is the plain
per-step loop, for decoding. State and decay arithmetic run in float32 (float64 stays float64).

Derivation of the chunkwise form (one chunk, steps t = 1..C, S_0 the state entering it, g_t the cumulative
log_alpha inside the chunk). Expanding the update,
    S_t = alpha_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t),
so S_t = exp(g_t) S_0 + sum_{j<=t} exp(g_t - g_j) k_j u_j^T. Putting that S_{t-1} back into u_t:
    u_t + sum_{j<t} beta_t exp(g_t - g_j) (k_t . k_j) u_j = beta_t v_t - beta_t exp(g_t) S_0^T k_t,
i.e. (I + A) U = diag(beta) V - diag(beta exp(g)) K S_0 with A strictly lower, A_tj = beta_t exp(g_t - g_j) k_t . k_j.
With T = (I + A)^{-1}, W = T diag(beta exp(g)) K and U~ = T diag(beta) V (both independent of S_0):
    U     = U~ - W S_0                                       (the "pseudo-values" the chunk writes)
    o_t   = scale * (exp(g_t) q_t^T S_0 + sum_{j<=t} exp(g_t - g_j) (q_t . k_j) u_j)
    S_C   = exp(g_C) S_0 + sum_j exp(g_C - g_j) k_j u_j^T
T, W, U~ and the intra-chunk scores are computed for all chunks at once; only U, S_C need the sequential pass.

A reset at step t (`reset` [B, T] bool: a document starts) clears the state before t's update, which is alpha_t = 0.
Every exp(g_t - g_j), exp(g_t) and exp(g_C - g_j) above is a product of alphas, so a reset multiplies the ones that
span it by 0 (`ChunkDocuments`' masks) and the log-decays stay finite.
"""

import torch

from lm.ops.common import (
    ChunkDocuments,
    autocast_off,
    causal_decay,
    check_shapes,
    compute_dtype,
    effective_chunk_size,
    from_head_chunks,
    initial_state_or_zeros,
    keep_state,
    to_head_chunks,
)
from lm.ops.fla import fla_delta_rule, use_fla


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_alpha: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    initial_state: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise (gated) delta rule.

    q, k: [B, T, H, K] (k is usually L2-normalised); v: [B, T, H, V]; beta, log_alpha: [B, T, H] (log_alpha None
    means alpha = 1); initial_state: [B, H, K, V] or None (zeros); reset: [B, T] bool or None, True where the state
    is cleared before the step (a document starts). Any T works. Returns (out [B, T, H, V] in q's dtype,
    final_state [B, H, K, V] in float32, or float64 for float64 inputs).
    backend: "torch" (this code), "fla" (flash-linear-attention's chunk_delta_rule / chunk_gated_delta_rule, CUDA and
    bf16/fp16 only; with resets their variable-length form) or "auto" (fla for CUDA bf16/fp16 inputs when it imports,
    else torch).
    """
    check_shapes(q, k, v, initial_state, reset=reset, beta=beta, log_alpha=log_alpha)
    if use_fla(backend, q, k, v, beta, log_alpha, initial_state, op="delta_rule"):
        return fla_delta_rule(q, k, v, beta, log_alpha, scale, initial_state, reset)
    chunk_size = effective_chunk_size(chunk_size, q.shape[1])
    return _chunkwise(q, k, v, beta, log_alpha, scale, initial_state, reset, chunk_size)


def _wy_transform(k, v, beta, g, decay, from_start):
    """Per chunk, solve (I + A) [W | U~] = [beta exp(g) k | beta v] (module docstring) for all chunks at once.

    k [B, H, N, C, K], v [B, H, N, C, V], beta, g and from_start = exp(g) [B, H, N, C], decay = exp(g_t - g_j) for
    t >= j [B, H, N, C, C] (both 0 across a reset). A is strictly lower triangular, so this is one
    unit-lower-triangular solve (forward substitution) with K + V right-hand sides; no inverse is formed.
    """
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    rhs = torch.cat([k * (beta * from_start)[..., None], v * beta[..., None]], dim=-1)
    w_u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    return w_u.split([k.shape[-1], v.shape[-1]], dim=-1)


@autocast_off()
def _chunkwise(q, k, v, beta, log_alpha, scale, initial_state, reset, chunk_size):
    """The chunkwise algorithm of the module docstring. Padded steps (zero q/k/v, beta = 0, log_alpha = 0) leave the
    state untouched: alpha = 1 and beta = 0 make their update the identity."""
    T, V, in_dtype, dtype = q.shape[1], v.shape[-1], q.dtype, compute_dtype(q)
    state = initial_state_or_zeros(initial_state, q, V, dtype)
    docs = ChunkDocuments.of(reset, chunk_size, dtype)
    q, k, v = (to_head_chunks(x, chunk_size, dtype) for x in (q, k, v))  # [B, H, N, C, K or V]
    beta = to_head_chunks(beta, chunk_size, dtype)  # [B, H, N, C]
    if log_alpha is None:
        g = torch.zeros_like(beta)
    else:
        g = to_head_chunks(log_alpha, chunk_size, dtype).cumsum(-1)
    g_last = g[..., -1:]  # [B, H, N, 1], log-decay over the whole chunk
    decay = causal_decay(g, docs)  # exp(g_t - g_j) for t >= j, 0 above the diagonal (and across a reset)
    to_end, from_start, chunk_decay = (g_last - g).exp(), g.exp(), g_last.exp()  # every exponent <= 0
    if docs is not None:
        to_end, from_start, chunk_decay = to_end * docs.to_end, from_start * docs.from_start, chunk_decay * docs.whole

    w, u_tilde = _wy_transform(k, v, beta, g, decay, from_start)
    scores = (q @ k.transpose(-1, -2)) * decay  # intra-chunk, decayed, causal (diagonal included)
    k_to_end = k * to_end[..., None]  # decay from step j to the chunk's end

    # Sequential pass over chunks: the pseudo-values u depend on the state entering the chunk.
    entering, pseudo_values = [], []
    for n in range(q.shape[2]):
        u = u_tilde[:, :, n] - w[:, :, n] @ state  # [B, H, C, V]
        entering.append(state)
        pseudo_values.append(u)
        state = chunk_decay[:, :, n, :, None] * state + k_to_end[:, :, n].transpose(-1, -2) @ u
    entering = torch.stack(entering, dim=2)  # [B, H, N, K, V]
    u = torch.stack(pseudo_values, dim=2)  # [B, H, N, C, V]

    out = torch.einsum("bhnck,bhnkv->bhncv", q * from_start[..., None], entering) + scores @ u
    return (scale * from_head_chunks(out, T)).to(in_dtype), state


@autocast_off()
def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_alpha: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    initial_state: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent (gated) delta rule: a plain loop over t, for decoding (T=1 with a carried state). Same arguments and
    results as `delta_rule`."""
    check_shapes(q, k, v, initial_state, reset=reset, beta=beta, log_alpha=log_alpha)
    in_dtype, dtype = q.dtype, compute_dtype(q)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    state = initial_state_or_zeros(initial_state, q, v.shape[-1], dtype)
    outs = []
    for t in range(q.shape[1]):
        if reset is not None:
            state = state * keep_state(reset[:, t], dtype)[:, None, None, None]
        k_t, b_t = k[:, t], beta[:, t, :, None]  # [B, H, K], [B, H, 1]
        if log_alpha is not None:
            state = log_alpha[:, t, :, None, None].to(dtype).exp() * state
        # alpha (I - beta k k^T) S + beta k v^T = alpha S + beta k (v - alpha S^T k)^T, without forming I - beta k k^T.
        error = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k_t)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, b_t * error)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    out = scale * torch.stack(outs, dim=1)
    return out.to(in_dtype), state

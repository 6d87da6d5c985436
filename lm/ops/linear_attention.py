"""Gated linear attention, the recurrence behind Mamba2's SSD, RetNet and GLA:

    S_t = gamma_t S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t,    gamma_t = exp(log_gamma_t)

with state S of shape [B, H, K, V]. Mamba2's SSD is this with q=C, k=B, v=x, beta=dt, log_gamma=dt*A. The decay is a
scalar per head and step (log_gamma [B, T, H]) or, as in GLA (Yang et al. 2024), one per key dimension
(log_gamma [B, T, H, K]: S_t = diag(gamma_t) S_{t-1} + beta_t k_t v_t^T).

`linear_attention` is the chunkwise form for training: within a chunk the outputs are a masked (decayed) attention
product, across chunks only the [K, V] state is carried. `linear_attention_recurrent` is the plain per-step loop, for
decoding. Both keep state and decay arithmetic in float32 (float64 stays float64) and return the output in the
input dtype. Both take `reset` [B, T] bool: where True, S_{t-1} := 0 before step t's update (packed documents).
"""

import torch

from lm.ops import self_check
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
from lm.ops.fla import CHECK_T, fla_agrees, fla_linear_attention, use_fla


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    initial_state: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
    chunk_size: int = 64,
    sub_chunk: int = 8,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise gated linear attention.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_gamma: [B, T, H] (a decay per head) or [B, T, H, K] (per key
    dimension, GLA); beta: [B, T, H] (None means 1); initial_state: [B, H, K, V] or None (zeros); reset: [B, T]
    bool or None, True where the state is cleared before the step (a document starts), anywhere. Any T works.
    Returns (out [B, T, H, V] in q's dtype, final_state [B, H, K, V] in float32, or float64 for float64 inputs).
    sub_chunk: the secondary chunk length of the per-key form (unused for a scalar decay); the chunk length is
    rounded up to a multiple of it. Its elementwise [c, c, K] diagonal blocks dominate the per-key form's time on
    CPU, so a smaller c is faster there (docs/performance-history.md, "Sequence ops"); 8 rather than 4 keeps the loop
    over sub-chunks (C / c steps, each a few kernels on a GPU) short.
    backend: "torch" (this code), "fla" (flash-linear-attention's chunk_simple_gla, or chunk_gla for a per-key
    decay; CUDA only) or "auto" (fla for CUDA bf16/fp16 inputs when it imports, else torch). fla picks its own chunk
    size; with resets it runs fla's variable-length form (lm.ops.fla.varlen).
    """
    check_shapes(q, k, v, initial_state, per_key=("log_gamma",), reset=reset, log_gamma=log_gamma, beta=beta)
    per_key = log_gamma.dim() == 4
    gated_kernel = None if per_key else "simple_gla"
    if use_fla(backend, q, k, v, log_gamma, beta, initial_state, op="linear_attention", gated_kernel=gated_kernel) \
            and _fla_agrees(q, k, v, log_gamma, beta, scale, initial_state, reset, gated_kernel):
        return fla_linear_attention(q, k, v, log_gamma, beta, scale, initial_state, reset)
    chunk_size = effective_chunk_size(chunk_size, q.shape[1])
    if per_key:
        sub_chunk = effective_chunk_size(sub_chunk, chunk_size)
        chunk_size = -(-chunk_size // sub_chunk) * sub_chunk  # a whole number of sub-chunks
        return _chunkwise_per_key(q, k, v, log_gamma, beta, scale, initial_state, reset, chunk_size, sub_chunk)
    return _chunkwise(q, k, v, log_gamma, beta, scale, initial_state, reset, chunk_size)


def _fla_agrees(q, k, v, log_gamma, beta, scale, initial_state, reset, gated_kernel) -> bool:
    """fla's self-check for this call's shape class (lm.ops.fla.fla_agrees): the dtypes, the head sizes, a per-key
    decay or not, beta, an initial state and resets or not; the input is as tests/test_ops_gpu.py's, smaller."""
    K, V, per_key = q.shape[-1], v.shape[-1], log_gamma.dim() == 4
    dtypes = tuple(None if t is None else t.dtype for t in (q, k, v, log_gamma, beta, initial_state))
    shape_class = (dtypes, K, V, per_key, reset is not None)

    def make_inputs(g):
        B, T, H = 1, CHECK_T, 2
        decay_shape = (B, T, H, K) if per_key else (B, T, H)
        return dict(
            q=self_check.normal(g, B, T, H, K, dtype=q.dtype).requires_grad_(),
            k=self_check.unit(g, B, T, H, K, dtype=k.dtype).requires_grad_(),
            v=self_check.normal(g, B, T, H, V, dtype=v.dtype).requires_grad_(),
            log_gamma=self_check.log_decay(g, *decay_shape, dtype=log_gamma.dtype).requires_grad_(),
            beta=None if beta is None else torch.rand(B, T, H, generator=g, device=g.device).to(beta.dtype)
            .requires_grad_(),
            initial_state=None if initial_state is None else self_check.normal(
                g, B, H, K, V, scale=0.1, dtype=initial_state.dtype).requires_grad_(),
            reset=None if reset is None else self_check.resets(B, T, q.device),
        )

    def run(backend):
        def call(**x):
            out, state = linear_attention(**x, scale=scale, backend=backend)
            return dict(out=out, state=state)

        return call

    return fla_agrees("linear_attention", "chunk_gla" if per_key else "chunk_simple_gla", run, make_inputs, q,
                      shape_class, gated_kernel)


def _scan_chunks(state, chunk_decay, chunk_states):
    """The inter-chunk pass: S_n = chunk_decay_n * S_{n-1} + chunk_states_n, a short sequential loop over the N chunks.

    state: [B, H, K, V], entering the first chunk; chunk_decay: [B, H, N, 1 or K, 1], the decay over each whole
    chunk; chunk_states: [B, H, N, K, V], what each chunk writes, decayed to its end. Returns (the state entering
    every chunk [B, H, N, K, V], the final state).
    """
    entering = []
    for decay, write in zip(chunk_decay.unbind(2), chunk_states.unbind(2)):  # unbind: see _chunkwise_per_key
        entering.append(state)
        state = decay * state + write
    return torch.stack(entering, dim=2), state


@autocast_off()
def _chunkwise(q, k, v, log_gamma, beta, scale, initial_state, reset, chunk_size):
    """The chunkwise algorithm. All intra-chunk work is batched over chunks; only the state pass loops over them.

    With b_i the cumulative log-decay inside a chunk (b_i = sum of log_gamma up to and including step i) and S the
    state entering the chunk:
        o_i   = scale * (exp(b_i) q_i^T S + sum_{j<=i} exp(b_i - b_j) beta_j (q_i . k_j) v_j)
        S_new = exp(b_last) S + sum_j exp(b_last - b_j) beta_j k_j v_j^T
    The padded tail (zero keys/values, zero log-decay) neither writes to nor decays the state. Resets multiply every
    decay that spans one by 0 (`ChunkDocuments`).
    """
    T, V, in_dtype, dtype = q.shape[1], v.shape[-1], q.dtype, compute_dtype(q)
    state = initial_state_or_zeros(initial_state, q, V, dtype)
    docs = ChunkDocuments.of(reset, chunk_size, dtype)
    if beta is not None:
        # beta only scales what step j writes, so it can ride on the key: beta_j k_j v_j^T = (beta_j k_j) v_j^T.
        k = k.to(dtype) * beta.to(dtype)[..., None]
    q, k, v = (to_head_chunks(x, chunk_size, dtype) for x in (q, k, v))  # [B, H, N, C, K or V]
    b = to_head_chunks(log_gamma, chunk_size, dtype).cumsum(-1)  # [B, H, N, C]
    b_last = b[..., -1:]  # [B, H, N, 1], log-decay over the whole chunk
    to_end, from_start, chunk_decay = (b_last - b).exp(), b.exp(), b_last.exp()
    if docs is not None:
        to_end, from_start, chunk_decay = to_end * docs.to_end, from_start * docs.from_start, chunk_decay * docs.whole

    # Intra-chunk: causal attention weighted by the decay between the two steps, for all chunks at once.
    scores = torch.einsum("bhnik,bhnjk->bhnij", q, k) * causal_decay(b, docs)
    out = scores @ v

    # What each chunk adds to the state, decayed to the chunk's end (b_last - b_j <= 0: no overflow).
    chunk_states = torch.einsum("bhnck,bhncv->bhnkv", k * to_end[..., None], v)  # [B, H, N, K, V]

    # Inter-chunk: a short sequential scan over chunks carries the state; keep the state entering every chunk.
    entering, state = _scan_chunks(state, chunk_decay[..., None], chunk_states)  # [B, H, N, K, V]

    # Query part of the carried state, decayed from the chunk start to step i.
    out = out + torch.einsum("bhnck,bhnkv->bhncv", q * from_start[..., None], entering)
    return (scale * from_head_chunks(out, T)).to(in_dtype), state


@autocast_off()
def _chunkwise_per_key(q, k, v, log_gamma, beta, scale, initial_state, reset, chunk_size, sub_chunk):
    """The chunkwise algorithm with a decay per key dimension (GLA), with GLA's secondary chunking.

    With b_t the cumulative log-decay inside a chunk, now a vector over the key dimensions, the weight of key s for
    query t >= s is exp(b_t - b_s) elementwise, so the score q_t . (exp(b_t - b_s) * k_s) no longer factors into one
    C x C matrix times a scalar decay. Factoring it as (q_t exp(b_t)) . (k_s exp(-b_s)) would overflow: -b_s reaches
    hundreds within a chunk when some dimension decays fast. So the chunk is cut into sub-chunks of length c, and:
    - for keys in an earlier sub-chunk j < i than the query's, exp(b_t - b_s) = exp(b_t - b_r) exp(b_r - b_s) with
      r the last step before sub-chunk i: s <= r < t, so both exponents are <= 0 and the scores are one matrix
      product of decayed queries and keys;
    - within the diagonal sub-chunk the [c, c, K] differences b_t - b_s are formed and exponentiated directly
      (masked to -inf above the diagonal before exp, as in `causal_decay`).
    The state pass is the scalar one with a vector decay; all its exponents (b_last - b_s, b_t) are <= 0 too:
        o_t   = scale * ((q_t * exp(b_t)) S + sum_{s<=t} (q_t . (exp(b_t - b_s) * k_s)) beta_s v_s)
        S_new = exp(b_last) * S + sum_s (exp(b_last - b_s) * beta_s k_s) v_s^T
    Each exponent is summed directly over the steps it spans (sub-chunk-local cumulative sums, sums of what follows
    a step) rather than taken as a difference of chunk-level cumulative sums: in float32 such a difference carries
    the rounding of its terms (|b| ~ 50 leaves ~4e-6 absolute), so a slow dimension sitting next to fast ones in the
    chunk would lose that much relative accuracy; a direct sum's error scales with its own value.
    Resets: every product above is finite, so the [C, C] score matrix, the state's writes and its decays are simply
    multiplied by `ChunkDocuments`' masks.
    """
    T, V, in_dtype, dtype = q.shape[1], v.shape[-1], q.dtype, compute_dtype(q)
    state = initial_state_or_zeros(initial_state, q, V, dtype)
    docs = ChunkDocuments.of(reset, chunk_size, dtype)
    if beta is not None:
        k = k.to(dtype) * beta.to(dtype)[..., None]  # beta_s k_s v_s^T = (beta_s k_s) v_s^T
    q, k, v, g = (to_head_chunks(x, chunk_size, dtype) for x in (q, k, v, log_gamma))  # [B, H, N, C, K or V]
    c, C = sub_chunk, chunk_size
    q_sub, k_sub, g_sub = (x.unflatten(-2, (C // c, c)) for x in (q, k, g))  # [B, H, N, M, c, K]
    b_sub = g_sub.cumsum(-2)  # log-decay from the start of each sub-chunk, up to and including step t
    after_sub = _sum_after(g_sub)  # log-decay from step s to the end of its sub-chunk
    sub_total = b_sub[..., -1, :]  # [B, H, N, M, K], over each whole sub-chunk

    # Diagonal sub-chunks, all at once: [c, c, K] pairwise decays, -inf above the diagonal before exp.
    diff = b_sub[..., :, None, :] - b_sub[..., None, :, :]  # [B, H, N, M, c, c, K]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()[..., None]  # [c, c, 1]
    decay = diff.masked_fill(~causal, float("-inf")).exp()
    diagonal = (q_sub[..., :, None, :] * k_sub[..., None, :, :] * decay).sum(-1)  # [B, H, N, M, c, c]

    # Score rows of sub-chunk i: earlier sub-chunks through the reference point r, the diagonal block, zeros after.
    # Per-sub-chunk pieces come from unbind (and are joined by stack/cat), not x[..., i, :, :]: the backward of each
    # such slice would fill a zero gradient the size of the whole tensor.
    q_from_r = (q_sub * b_sub.exp()).unbind(-3)  # q_t decayed from r (the start of its sub-chunk) to t
    k_to_end = (k_sub * after_sub.exp()).unbind(-3)  # k_s decayed to the end of its sub-chunk
    rows = []
    for i, block in enumerate(diagonal.unbind(-3)):
        blocks = []
        if i > 0:
            # decay from the end of sub-chunk j < i to r: the whole sub-chunks between them (small: [B, H, N, i, K])
            between = _sum_after(sub_total[..., :i, :]).exp()[..., None, :]
            k_before = (torch.stack(k_to_end[:i], dim=-3) * between).flatten(-3, -2)  # [B, H, N, i c, K]
            blocks.append(q_from_r[i] @ k_before.transpose(-1, -2))  # [B, H, N, c, i c]
        blocks.append(block)
        blocks.append(q.new_zeros(*q.shape[:3], c, C - (i + 1) * c))  # later keys: causal mask
        rows.append(torch.cat(blocks, dim=-1))
    scores = torch.cat(rows, dim=-2)  # [B, H, N, C, C]
    if docs is not None:
        scores = scores * docs.same
    out = scores @ v

    # What each chunk adds to the state, decayed to the chunk's end, then the sequential pass over chunks.
    b = g.cumsum(-2)  # [B, H, N, C, K], from the chunk start
    to_end, from_start, chunk_decay = _sum_after(g).exp(), b.exp(), b[..., -1, :, None].exp()  # [B, H, N, K, 1]
    if docs is not None:
        to_end, from_start = to_end * docs.to_end[..., None], from_start * docs.from_start[..., None]
        chunk_decay = chunk_decay * docs.whole[..., None]
    chunk_states = torch.einsum("bhnck,bhncv->bhnkv", k * to_end, v)  # [B, H, N, K, V]
    entering, state = _scan_chunks(state, chunk_decay, chunk_states)

    # Query part of the carried state, decayed per key dimension from the chunk start to step t.
    out = out + torch.einsum("bhnck,bhnkv->bhncv", q * from_start, entering)
    return (scale * from_head_chunks(out, T)).to(in_dtype), state


def _sum_after(g: torch.Tensor) -> torch.Tensor:
    """sum_{u > s} g_u along dim -2 for every s (0 for the last step): the log-decay from step s to the end."""
    from_s = g.flip(-2).cumsum(-2).flip(-2)  # sum_{u >= s}
    return torch.cat([from_s[..., 1:, :], torch.zeros_like(g[..., :1, :])], dim=-2)


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
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent gated linear attention: a plain loop over t, for decoding (T=1 with a carried state) and as a
    readable statement of the recurrence. Same arguments and results as `linear_attention` (log_gamma [B, T, H] or
    [B, T, H, K])."""
    check_shapes(q, k, v, initial_state, per_key=("log_gamma",), reset=reset, log_gamma=log_gamma, beta=beta)
    in_dtype, dtype = q.dtype, compute_dtype(q)
    q, k, v, log_gamma = (x.to(dtype) for x in (q, k, v, log_gamma))
    if beta is not None:
        k = k * beta.to(dtype)[..., None]  # beta_t k_t v_t^T = (beta_t k_t) v_t^T
    # The decay multiplies the state's rows: [B, T, H, 1, 1] for a scalar, [B, T, H, K, 1] per key dimension.
    gamma = (log_gamma[..., None] if log_gamma.dim() == 4 else log_gamma[..., None, None]).exp()
    if reset is not None:  # a cleared state is a zero decay
        gamma = gamma * keep_state(reset, dtype)[:, :, None, None, None]
    state = initial_state_or_zeros(initial_state, q, v.shape[-1], dtype)
    outs = []
    # unbind rather than x[:, t]: the backward of T slices would write T full-size gradients.
    for q_t, k_t, v_t, gamma_t in zip(*(x.unbind(1) for x in (q, k, v, gamma))):
        state = gamma_t * state + torch.einsum("bhk,bhv->bhkv", k_t, v_t)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q_t))
    out = scale * torch.stack(outs, dim=1)
    return out.to(in_dtype), state

"""Kimi Delta Attention (KDA; Kimi Linear, arXiv 2510.26692) with GDN-2's channel gates:

    S_t = (I - k_t (b_t * k_t)^T) Diag(alpha_t) S_{t-1} + k_t (w_t * v_t)^T,    o_t = scale * S_t^T q_t,

alpha_t = exp(log_alpha_t), one decay per key channel (log_alpha [B, T, H, K]; one per head, [B, T, H], works too);
b_t the erase gate over the keys ([B, T, H, K]) and w_t the write gate over the values ([B, T, H, V]). b = w = beta, a
scalar per head ([B, T, H]), is KDA: S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T.
The state S is [B, H, K, V], keys along the rows, as lm.ops.delta_rule and fla's naive_recurrent_kda /
naive_recurrent_gdn2 hold it (their h is [B, H, K, V], decayed along K, read as q^T h), so states pass between them
as they are. The decay comes first, then the erase: the erase reads the decayed state. beta (and b) may lie in [0, 2]:
for a unit key the transition's eigenvalue along k, 1 - sum_c b_c k_c^2, then reaches [-1, 1] (negative eigenvalues,
arXiv 2411.12537); the forms below are exact for any gate values.

Both are cases of the generalised delta rule computed here (`generalized_delta`, also lm.ops.precond_delta_rule's core)
    S_t = D_t S_{t-1} + p_t u_t^T,  u_t = w_t - (D_t S_{t-1})^T r_t,  i.e. S_t = (I - p_t r_t^T) D_t S_{t-1} + p_t w_t^T
with a write key p, a read (erase) key r, a written value w and D_t = Diag(alpha_t): here p = k, r = b * k, w = w * v.

Chunkwise form (one chunk, steps 1..C, S_0 the state entering it, g_t the cumulative log-decay in the chunk, a vector
over the keys). Unrolling, S_t = Diag(exp(g_t)) S_0 + sum_{j<=t} (exp(g_t - g_j) * p_j) u_j^T, and putting S_{t-1}
back into u_t:  u_t + sum_{j<t} A_tj u_j = w_t - S_0^T (exp(g_t) * r_t),  A_tj = r_t . (exp(g_t - g_j) * p_j). With
T = (I + A)^{-1} (A strictly lower), W = T (exp(g) * R) and U~ = T W_values, independent of S_0:
    U   = U~ - W S_0
    o_t = scale * ((exp(g_t) * q_t)^T S_0 + sum_{j<=t} (q_t . (exp(g_t - g_j) * p_j)) u_j)
    S_C = Diag(exp(g_C)) S_0 + sum_j (exp(g_C - g_j) * p_j) u_j^T
The per-channel weights exp(g_t - g_j) are kept finite in float32 as GLA's (lm.ops.linear_attention), by sub-chunks of c
steps, whose pairs of steps are found by halves: the chunk's pairs (t, j) with t in its second half and j in its first
are one matrix product, the weight factored through the halves' boundary r as exp(g_t - g_r) exp(g_r - g_j), both
exponents <= 0; the pairs within each half are the same problem again, all the halves of one size at once; a lone
sub-chunk exponentiates its [c, c, K] differences directly, -inf above the diagonal (c = 1: a step's own key,
undecayed). Every exponent is a sum of log-decays over the steps it spans (never a difference of large cumulative sums),
so strong decays over long sequences neither overflow nor lose the weak channels' accuracy. The products take (C - c) K
multiply-adds per step for the scores and as many for A, as one product per sub-chunk against all the earlier ones
would, but in log2(C / c) rounds of batched products with a few elementwise passes over [C, K] each, rather than C / c
rounds and the [c, c, K] decays of every sub-chunk. On a CPU at small widths (the CPU ladder's), where the elementwise
work and the number of small kernels dominate, these weights are still about half of the op, and at matched parameters
KDA has two to three times Gated DeltaNet's heads (Gated DeltaNet takes its paper's half heads): that, not a slow path,
is why KDA trains there at about half of Gated DeltaNet's tokens/s (docs/performance.md, docs/mixers.md). With a decay
per head the plain C x C form of lm.ops.delta_rule is used instead. A reset (`reset` [B, T]) clears the state before its
step, which is a zero decay there: every weight that spans it is multiplied by 0 (`ChunkDocuments`' masks).
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
from lm.ops.delta_rule import UnitLowerInverse
from lm.ops.fla import CHECK_T, fla_agrees, fla_kda, kda_available, use_fla


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    erase: torch.Tensor | None = None,
    write: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
    chunk_size: int = 64,
    sub_chunk: int = 8,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise KDA (with GDN-2's channel gates).

    q, k: [B, T, H, K] (k usually L2-normalised); v: [B, T, H, V]; log_alpha: [B, T, H, K] (or [B, T, H]); beta:
    [B, T, H], the erase and write gate where `erase` / `write` are not given; erase: b, [B, T, H, K] (or [B, T, H]);
    write: w, [B, T, H, V] (or [B, T, H]); initial_state: [B, H, K, V] or None (zeros); reset: [B, T] bool or None,
    True where the state is cleared before the step. Any T works. Returns (out [B, T, H, V] in q's dtype, final_state
    [B, H, K, V] in float32, or float64 for float64 inputs). sub_chunk: the steps of the per-key decay whose pairwise
    decays are exponentiated directly (module docstring; the chunk is rounded up to a multiple of it). The KDA mixer
    defaults to chunk_size 32 and sub_chunk 1, the fastest on a CPU (docs/performance.md).
    backend: "torch" (this code), "fla" (fla's chunk_kda, or chunk_gdn2 with channel gates; CUDA, bf16/fp16) or
    "auto" (fla for CUDA bf16/fp16 inputs when it imports and passes its self-check, else torch).
    """
    erase, write = _gates(q, k, v, log_alpha, beta, erase, write, initial_state, reset)
    if use_fla(backend, q, k, v, log_alpha, erase, write, initial_state, op="kda", available=kda_available) \
            and _fla_agrees(q, k, v, log_alpha, beta, erase, write, scale, initial_state, reset):
        return fla_kda(q, k, v, log_alpha, beta, erase, write, scale, initial_state, reset)
    dtype = compute_dtype(q)
    k32 = k.to(dtype)
    return generalized_delta(q, k32 * _per_channel(erase, dtype), k32, v.to(dtype) * _per_channel(write, dtype),
                             log_alpha, scale, initial_state, reset, chunk_size, sub_chunk)


def _gates(q, k, v, log_alpha, beta, erase, write, initial_state, reset):
    """Check the shapes; the erase and write gates, beta where not given."""
    check_shapes(q, k, v, initial_state, per_key=("log_alpha", "erase"), reset=reset, log_alpha=log_alpha, beta=beta,
                 erase=erase)
    if log_alpha is None:
        raise ValueError("kda: log_alpha is required ([B, T, H, K], or [B, T, H])")
    if write is not None and write.shape not in (v.shape, v.shape[:3]):
        raise ValueError(f"expected write [B, T, H, V] = {tuple(v.shape)} or [B, T, H], got {tuple(write.shape)}")
    erase, write = beta if erase is None else erase, beta if write is None else write
    if erase is None or write is None:
        raise ValueError("kda: give beta, or both the erase and the write gates")
    return erase, write


def _per_channel(gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gate as a factor on [B, T, H, *] keys or values: [B, T, H] gets a trailing axis."""
    gate = gate.to(dtype)
    return gate if gate.dim() == 4 else gate[..., None]


def _fla_agrees(q, k, v, log_alpha, beta, erase, write, scale, initial_state, reset) -> bool:
    """fla's self-check for this call's shape class: the dtypes, the head sizes, the gates' shapes, an initial state
    and resets or not; the input is as tests/test_ops_gpu.py's, smaller."""
    K, V = q.shape[-1], v.shape[-1]
    channel_gates = beta is None or erase is not beta or write is not beta
    dtypes = tuple(None if t is None else t.dtype for t in (q, k, v, log_alpha, erase, write, initial_state))
    shape_class = (dtypes, K, V, log_alpha.dim(), erase.dim(), write.dim(), channel_gates, reset is not None)

    def make_inputs(g):
        B, T, H = 1, CHECK_T, 2
        def gate(like, top, *shape):  # uniform in [0, top], beta and b up to 2 (negative eigenvalues)
            return (top * torch.rand(*shape, generator=g, device=g.device)).to(like.dtype).requires_grad_()

        x = dict(
            q=self_check.normal(g, B, T, H, K, dtype=q.dtype).requires_grad_(),
            k=self_check.unit(g, B, T, H, K, dtype=k.dtype).requires_grad_(),
            v=self_check.normal(g, B, T, H, V, dtype=v.dtype).requires_grad_(),
            log_alpha=self_check.log_decay(g, B, T, H, *log_alpha.shape[3:], dtype=log_alpha.dtype).requires_grad_(),
            initial_state=None if initial_state is None else self_check.normal(
                g, B, H, K, V, scale=0.1, dtype=initial_state.dtype).requires_grad_(),
            reset=None if reset is None else self_check.resets(B, T, q.device),
        )
        if channel_gates:
            x["erase"] = gate(erase, 2, B, T, H, *erase.shape[3:])
            x["write"] = gate(write, 1, B, T, H, *write.shape[3:])
        else:
            x["beta"] = gate(beta, 2, B, T, H)
        return x

    def run(backend):
        def call(**x):
            out, state = kda(**x, scale=scale, backend=backend)
            return dict(out=out, state=state)

        return call

    return fla_agrees("kda", "chunk_gdn2" if channel_gates else "chunk_kda", run, make_inputs, q, shape_class)


@autocast_off()
def generalized_delta(q, read, write_key, values, log_alpha, scale, initial_state, reset, chunk_size, sub_chunk=8):
    """The chunkwise generalised delta rule S_t = (I - p_t r_t^T) D_t S_{t-1} + p_t w_t^T, o_t = scale * S_t^T q_t
    (module docstring): q, read r, write_key p [B, T, H, K], values w [B, T, H, V], log_alpha [B, T, H, K] (a decay
    per channel), [B, T, H] (per head) or None (none). Returns (out in q's dtype, final state). Padded steps (zero
    q, r, p, w and log-decay) leave the state as it is."""
    T, V, in_dtype, dtype = q.shape[1], values.shape[-1], q.dtype, compute_dtype(q)
    chunk_size = effective_chunk_size(chunk_size, T)
    per_key = log_alpha is not None and log_alpha.dim() == 4
    if per_key:
        sub_chunk = effective_chunk_size(sub_chunk, chunk_size)
        chunk_size = -(-chunk_size // sub_chunk) * sub_chunk  # a whole number of sub-chunks
    state = initial_state_or_zeros(initial_state, q, V, dtype)
    docs = ChunkDocuments.of(reset, chunk_size, dtype)
    q, r, p, w = (to_head_chunks(x, chunk_size, dtype) for x in (q, read, write_key, values))  # [B, H, N, C, *]

    if per_key:
        g = to_head_chunks(log_alpha, chunk_size, dtype)  # [B, H, N, C, K]
        scores, A = _pairwise_per_key((q, r), p, g, sub_chunk)
        if docs is not None:
            scores, A = scores * docs.same, A * docs.same
        # decay from the chunk's start to t, from j to the chunk's end, over the whole chunk: every exponent <= 0
        from_start, to_end = g.cumsum(-2).exp(), _sum_after(g).exp()
        chunk_decay = from_start[..., -1, :, None]  # [B, H, N, K, 1]
    else:
        if log_alpha is None and docs is None:
            decay = from_start = to_end = chunk_decay = None
        else:
            g = to_head_chunks(log_alpha, chunk_size, dtype).cumsum(-1) if log_alpha is not None else \
                q.new_zeros(q.shape[:-1])  # [B, H, N, C]
            decay = causal_decay(g, docs)  # exp(g_t - g_j), t >= j, 0 across a reset
            from_start, to_end = g.exp()[..., None], (g[..., -1:] - g).exp()[..., None]
            chunk_decay = g[..., -1:, None].exp()  # [B, H, N, 1, 1]
        qp, rp = q @ p.transpose(-1, -2), r @ p.transpose(-1, -2)
        scores, A = (qp.tril(), rp) if decay is None else (qp * decay, rp * decay)
    if docs is not None and from_start is not None:
        from_start, to_end = from_start * docs.from_start[..., None], to_end * docs.to_end[..., None]
        chunk_decay = chunk_decay * docs.whole[..., None]

    t_inv = UnitLowerInverse.apply(A.tril(-1))  # (I + A)^{-1}
    wy = t_inv @ (r if from_start is None else r * from_start)  # W
    u_tilde = t_inv @ w  # U~
    p_to_end = p if to_end is None else p * to_end

    # The sequential pass over chunks (unbind, not x[:, :, n]: see lm.ops.delta_rule).
    entering, pseudo_values = [], []
    decays = [None] * q.shape[2] if chunk_decay is None else chunk_decay.unbind(2)
    for u_n, w_n, p_n, d_n in zip(u_tilde.unbind(2), wy.unbind(2), p_to_end.transpose(-1, -2).unbind(2), decays):
        u = u_n - w_n @ state
        entering.append(state)
        pseudo_values.append(u)
        state = (state if d_n is None else d_n * state) + p_n @ u
    entering, u = torch.stack(entering, dim=2), torch.stack(pseudo_values, dim=2)

    q_start = q if from_start is None else q * from_start
    out = q_start @ entering + scores @ u
    return (scale * from_head_chunks(out, T)).to(in_dtype), state


def _pairwise_per_key(xs, p, g, c):
    """For each x in xs ([B, H, N, C, K]), the [B, H, N, C, C] matrix sum_k x_t,k p_j,k exp(g_t,k - g_j,k) for j <= t
    (0 above the diagonal), g the per-channel log-decays, by sub-chunks of c steps (module docstring)."""
    one_block = lambda x: x.unsqueeze(-3)  # noqa: E731  [B, H, N, 1, C, K]: the chunk as the tree's one block
    pairwise = _pairwise_tree([one_block(x) for x in xs], one_block(p), one_block(g), c, p.shape[-2] // c)
    return [m.squeeze(-3) for m in pairwise]


def _pairwise_tree(xs, p, g, c, leaves):
    """`_pairwise_per_key` of blocks of `leaves` sub-chunks ([..., blocks, leaves c, K]), by halves. The pairs of steps
    in different halves are one product: x_t decayed from the halves' boundary to t against p_j decayed from j to the
    boundary (both exponents <= 0, each a sum over the steps it spans). The pairs within a half are the same problem
    on fewer steps, both halves in one call (as twice the blocks) when they are of one size. A lone sub-chunk
    exponentiates its [c, c, K] differences directly, -inf above the diagonal before exp (no inf, no NaN backward).
    Whatever the split, every pair of steps in different sub-chunks is in exactly one product: (C - c) K
    multiply-adds per step and x, as one product per sub-chunk against all earlier ones would take, in log2(C / c)
    rounds of batched products rather than C / c of ever wider ones."""
    if leaves == 1 and c == 1:  # a single step: its own key, undecayed
        return [(x * p).sum(-1, keepdim=True) for x in xs]
    if leaves == 1:
        b = g.cumsum(-2)  # log-decay from the step before the sub-chunk to t
        causal = torch.ones(c, c, dtype=torch.bool, device=p.device).tril()[..., None]
        decayed_p = (b[..., :, None, :] - b[..., None, :, :]).masked_fill(~causal, float("-inf")).exp() \
            * p[..., None, :, :]  # [..., c, c, K]
        return [(x[..., :, None, :] * decayed_p).sum(-1) for x in xs]
    first = leaves // 2
    h = first * c  # steps in the first half
    into = g[..., h:, :].cumsum(-2).exp()  # from the boundary to t, for t in the second half
    p_first = p[..., :h, :] * _sum_after(g[..., :h, :]).exp()  # p_j decayed from j to the boundary
    x_second = torch.cat([x[..., h:, :] * into for x in xs], dim=-2)  # all xs in one product
    crosses = (x_second @ p_first.transpose(-1, -2)).split(into.shape[-2], dim=-2)
    if 2 * first == leaves:
        as_blocks = lambda x: x.unflatten(-2, (2, h)).flatten(-4, -3)  # noqa: E731  the halves as blocks
        within = [m.unflatten(-3, (-1, 2)).unbind(-3)
                  for m in _pairwise_tree([as_blocks(x) for x in xs], as_blocks(p), as_blocks(g), c, first)]
    else:
        within = zip(_pairwise_tree([x[..., :h, :] for x in xs], p[..., :h, :], g[..., :h, :], c, first),
                     _pairwise_tree([x[..., h:, :] for x in xs], p[..., h:, :], g[..., h:, :], c, leaves - first))
    pairwise = []
    for (first_half, second_half), cross in zip(within, crosses):
        above = first_half.new_zeros(*first_half.shape[:-1], second_half.shape[-1])
        pairwise.append(torch.cat([torch.cat([first_half, above], -1), torch.cat([cross, second_half], -1)], -2))
    return pairwise


def _sum_after(g: torch.Tensor) -> torch.Tensor:
    """sum_{u > s} g_u along dim -2 for every s (0 for the last): the log-decay from step s to the end."""
    from_s = g.flip(-2).cumsum(-2).flip(-2)
    return torch.cat([from_s[..., 1:, :], torch.zeros_like(g[..., :1, :])], dim=-2)


@autocast_off()
def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    erase: torch.Tensor | None = None,
    write: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent KDA: a plain loop over t, for decoding. Same arguments and results as `kda`."""
    erase, write = _gates(q, k, v, log_alpha, beta, erase, write, initial_state, reset)
    dtype = compute_dtype(q)
    k32 = k.to(dtype)
    return generalized_delta_recurrent(q, k32 * _per_channel(erase, dtype), k32,
                                       v.to(dtype) * _per_channel(write, dtype), log_alpha, scale, initial_state, reset)


@autocast_off()
def generalized_delta_recurrent(q, read, write_key, values, log_alpha, scale, initial_state, reset):
    """The generalised delta rule step by step (same arguments as `generalized_delta`)."""
    in_dtype, dtype = q.dtype, compute_dtype(q)
    q, r, p, w = (x.to(dtype) for x in (q, read, write_key, values))
    state = initial_state_or_zeros(initial_state, q, w.shape[-1], dtype)
    # D_t on the state's rows ([B, T, H, K or 1, 1]), times 0 where the state is cleared; None: no decay
    decay = None
    if log_alpha is not None:
        decay = log_alpha.to(dtype).exp()
        decay = decay[..., None] if decay.dim() == 4 else decay[..., None, None]
    if reset is not None:
        decay = keep_state(reset, dtype)[:, :, None, None, None] * (1 if decay is None else decay)
    decays = [None] * q.shape[1] if decay is None else decay.unbind(1)
    outs = []
    for q_t, r_t, p_t, w_t, d_t in zip(*(x.unbind(1) for x in (q, r, p, w)), decays):
        state = state if d_t is None else d_t * state
        error = w_t - torch.einsum("bhkv,bhk->bhv", state, r_t)  # u_t = w_t - (D_t S_{t-1})^T r_t
        state = state + torch.einsum("bhk,bhv->bhkv", p_t, error)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q_t))
    return (scale * torch.stack(outs, dim=1)).to(in_dtype), state


def kda_transfer(q, k, v, log_alpha, beta=None, scale=1.0, *, erase=None, write=None, reset=None, chunk_size=64,
                 sub_chunk=8, backend="auto"):
    """(final state from zero [B, H, K, V], map [B, H, K, K]) of a KDA piece, for context parallelism: its final state
    from `initial` is final_from_zero + map @ initial (`carry_kda`). The state's value columns evolve independently
    (the transition acts on the keys' side), so K more value columns that start as the identity and are written 0
    (v = 0 there, whatever the write gate) end as the product of the steps' transitions, in the same call."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype = compute_dtype(q)
    eye = torch.eye(K, dtype=dtype, device=v.device)
    initial = torch.cat([eye.new_zeros(B, H, K, V), eye.expand(B, H, K, K)], dim=-1)
    wide_v = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    if write is not None and write.dim() == 4:
        write = torch.cat([write, write.new_zeros(B, T, H, K)], dim=-1)
    _, final = kda(q, k, wide_v, log_alpha, beta, scale, erase=erase, write=write, initial_state=initial,
                   reset=reset, chunk_size=chunk_size, sub_chunk=sub_chunk, backend=backend)
    return final[..., :V], final[..., V:]


def carry_kda(initial, transfer: torch.Tensor, final_from_zero: torch.Tensor):
    """final_from_zero + transfer @ initial per head (initial None: the zero state)."""
    if initial is None:
        return final_from_zero
    return final_from_zero + transfer @ initial.to(transfer.dtype)

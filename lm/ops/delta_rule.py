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
from lm.ops.fla import CHECK_T, fla_agrees, fla_delta_rule, use_fla


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
    gated_kernel = None if log_alpha is None else "gated_delta_rule"
    if use_fla(backend, q, k, v, beta, log_alpha, initial_state, op="delta_rule", gated_kernel=gated_kernel) \
            and _fla_agrees(q, k, v, beta, log_alpha, scale, initial_state, reset, gated_kernel):
        return fla_delta_rule(q, k, v, beta, log_alpha, scale, initial_state, reset)
    chunk_size = effective_chunk_size(chunk_size, q.shape[1])
    return _chunkwise(q, k, v, beta, log_alpha, scale, initial_state, reset, chunk_size)


def _fla_agrees(q, k, v, beta, log_alpha, scale, initial_state, reset, gated_kernel) -> bool:
    """fla's self-check for this call's shape class (lm.ops.fla.fla_agrees): the dtypes, the head sizes, gated or
    not, an initial state and resets or not; the input is as tests/test_ops_gpu.py's, smaller."""
    K, V = q.shape[-1], v.shape[-1]
    dtypes = tuple(None if t is None else t.dtype for t in (q, k, v, beta, log_alpha, initial_state))
    shape_class = (dtypes, K, V, reset is not None)

    def make_inputs(g):
        B, T, H = 1, CHECK_T, 2
        return dict(
            q=self_check.normal(g, B, T, H, K, dtype=q.dtype).requires_grad_(),
            k=self_check.unit(g, B, T, H, K, dtype=k.dtype).requires_grad_(),
            v=self_check.normal(g, B, T, H, V, dtype=v.dtype).requires_grad_(),
            beta=torch.rand(B, T, H, generator=g, device=g.device).to(beta.dtype).requires_grad_(),
            log_alpha=None if log_alpha is None else self_check.log_decay(g, B, T, H, dtype=log_alpha.dtype)
            .requires_grad_(),
            initial_state=None if initial_state is None else self_check.normal(
                g, B, H, K, V, scale=0.1, dtype=initial_state.dtype).requires_grad_(),
            reset=None if reset is None else self_check.resets(B, T, q.device),
        )

    def run(backend):
        def call(**x):
            out, state = delta_rule(**x, scale=scale, backend=backend)
            return dict(out=out, state=state)

        return call

    kernel = "chunk_delta_rule" if gated_kernel is None else "chunk_gated_delta_rule"
    return fla_agrees("delta_rule", kernel, run, make_inputs, q, shape_class, gated_kernel)


def _unit_lower_inverse_forward(a: torch.Tensor) -> torch.Tensor:
    """(I + a)^{-1} for a strictly lower triangular [..., C, C], by halves: with T11, T22 the inverses of the diagonal
    blocks, the inverse is [[T11, 0], [-T22 a21 T11, T22]]. Down to blocks of 16, which one triangular solve
    inverts. On a CPU this is about twice as fast as one solve of the whole C x C system (its matmuls run near
    matmul speed, a triangular solve does not)."""
    C = a.shape[-1]
    if C <= 16:
        eye = torch.eye(C, dtype=a.dtype, device=a.device)
        return torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    h = C // 2
    t11, t22 = _unit_lower_inverse_forward(a[..., :h, :h]), _unit_lower_inverse_forward(a[..., h:, h:])
    t21 = -t22 @ (a[..., h:, :h] @ t11)
    return torch.cat([torch.cat([t11, torch.zeros_like(a[..., :h, h:])], -1), torch.cat([t21, t22], -1)], -2)


class UnitLowerInverse(torch.autograd.Function):
    """T = (I + a)^{-1} for a strictly lower triangular a, with the backward dL/da = -T^T (dL/dT) T^T: two matmuls,
    where autograd through a triangular solve (or through the halves above) would take a solve or many small ops.
    The gradient is returned whole; the caller's tril(-1) keeps only its strictly lower part."""

    @staticmethod
    def forward(ctx, a):
        t = _unit_lower_inverse_forward(a)
        ctx.save_for_backward(t)
        return t

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        t_T = t.transpose(-1, -2)
        return -(t_T @ grad @ t_T)


def _wy_transform(k, v, beta, decay, from_start):
    """Per chunk, solve (I + A) [W | U~] = [beta exp(g) k | beta v] (module docstring) for all chunks at once.

    k [B, H, N, C, K], v [B, H, N, C, V], beta [B, H, N, C], from_start = exp(g) [B, H, N, C] or None (1: no decay),
    decay = exp(g_t - g_j) for t >= j [B, H, N, C, C] or None (no decay: the causal mask alone; both are 0 across a
    reset). A is strictly lower triangular; its inverse T = (I + A)^{-1} is formed once and applied to both
    right-hand sides by matmuls: W = T diag(beta exp(g)) K, U~ = T diag(beta) V.
    """
    kk = k @ k.transpose(-1, -2)
    A = (beta[..., :, None] * (kk if decay is None else kk * decay)).tril(-1)
    t_beta = UnitLowerInverse.apply(A) * beta[..., None, :]  # T diag(beta)
    w = t_beta @ (k if from_start is None else k * from_start[..., None])
    return w, t_beta @ v


@autocast_off()
def _chunkwise(q, k, v, beta, log_alpha, scale, initial_state, reset, chunk_size):
    """The chunkwise algorithm of the module docstring. Padded steps (zero q/k/v, beta = 0, log_alpha = 0) leave the
    state untouched: alpha = 1 and beta = 0 make their update the identity. Without a decay or resets (DeltaNet's
    training) every decay factor is 1 and only the causal masks remain, so they are left out."""
    T, V, in_dtype, dtype = q.shape[1], v.shape[-1], q.dtype, compute_dtype(q)
    state = initial_state_or_zeros(initial_state, q, V, dtype)
    docs = ChunkDocuments.of(reset, chunk_size, dtype)
    q, k, v = (to_head_chunks(x, chunk_size, dtype) for x in (q, k, v))  # [B, H, N, C, K or V]
    beta = to_head_chunks(beta, chunk_size, dtype)  # [B, H, N, C]
    if log_alpha is None and docs is None:
        decay = to_end = from_start = chunk_decay = None
    else:
        g = torch.zeros_like(beta) if log_alpha is None else to_head_chunks(log_alpha, chunk_size, dtype).cumsum(-1)
        g_last = g[..., -1:]  # [B, H, N, 1], log-decay over the whole chunk
        decay = causal_decay(g, docs)  # exp(g_t - g_j) for t >= j, 0 above the diagonal (and across a reset)
        to_end, from_start, chunk_decay = (g_last - g).exp(), g.exp(), g_last.exp()  # every exponent <= 0
        if docs is not None:
            to_end, from_start = to_end * docs.to_end, from_start * docs.from_start
            chunk_decay = chunk_decay * docs.whole

    w, u_tilde = _wy_transform(k, v, beta, decay, from_start)
    qk = q @ k.transpose(-1, -2)
    scores = qk.tril() if decay is None else qk * decay  # intra-chunk, decayed, causal (diagonal included)
    k_to_end = k if to_end is None else k * to_end[..., None]  # decay from step j to the chunk's end

    # Sequential pass over chunks: the pseudo-values u depend on the state entering the chunk. The chunks' pieces
    # come from unbind, not x[:, :, n]: the backward of each such slice would fill a zero gradient of the whole size.
    entering, pseudo_values = [], []
    decays = [None] * q.shape[2] if chunk_decay is None else chunk_decay[..., None].unbind(2)
    for u_n, w_n, k_n, d_n in zip(u_tilde.unbind(2), w.unbind(2), k_to_end.transpose(-1, -2).unbind(2), decays):
        u = u_n - w_n @ state  # [B, H, C, V]
        entering.append(state)
        pseudo_values.append(u)
        state = (state if d_n is None else d_n * state) + k_n @ u
    entering = torch.stack(entering, dim=2)  # [B, H, N, K, V]
    u = torch.stack(pseudo_values, dim=2)  # [B, H, N, C, V]

    q_start = q if from_start is None else q * from_start[..., None]
    out = q_start @ entering + scores @ u
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
    # alpha_t, times 0 where the state is cleared ([B, T, H]); None: DeltaNet without resets, alpha = 1
    alpha = None if log_alpha is None else log_alpha.to(dtype).exp()
    if reset is not None:
        alpha = keep_state(reset, dtype)[:, :, None] * (1 if alpha is None else alpha)
    alphas = [None] * q.shape[1] if alpha is None else alpha[..., None, None].unbind(1)
    outs = []
    # unbind rather than x[:, t]: the backward of T slices would write T full-size gradients.
    for q_t, k_t, v_t, b_t, a_t in zip(*(x.unbind(1) for x in (q, k, v, beta[..., None])), alphas):
        state = state if a_t is None else a_t * state
        # alpha (I - beta k k^T) S + beta k v^T = alpha S + beta k (v - alpha S^T k)^T, without forming I - beta k k^T.
        error = v_t - torch.einsum("bhkv,bhk->bhv", state, k_t)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, b_t * error)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q_t))
    out = scale * torch.stack(outs, dim=1)
    return out.to(in_dtype), state

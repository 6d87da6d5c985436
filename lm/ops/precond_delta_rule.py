"""The preconditioned gated delta rule (Tumma, Loo, Rus; arXiv 2604.21100), as fla's
naive_recurrent_precond_gated_delta_rule defines it: the delta rule read as one step of online least squares, its step
scaled by a diagonal preconditioner M_t estimated online from a second gated state A over the keys:

    A_t = alpha^A_t A_{t-1} + beta^A_t k_t^2                            (elementwise; A [B, H, K])
    M_t = exp(-log(squash) * s(log(A_t + eps) - center)),  s(r) = r / (1 + |r|)   (so M_t lies in (1/squash, squash))
    S_t = alpha_t S_{t-1} + (M_t * k_t) beta_t (v_t - alpha_t S_{t-1}^T k_t)^T
        = (I - beta_t (M_t * k_t) k_t^T) alpha_t S_{t-1} + beta_t (M_t * k_t) v_t^T,      o_t = scale * S_t^T q_t,

alpha = exp(log_alpha) ([B, T, H]; None: 1), alpha^A = exp(log_alpha_a), beta, beta_a [B, T, H]; center a float or
one per head ([H]; fla's log_atk_scale, -0.2 by default), squash fla's x (1.5), eps 1e-6. S [B, H, K, V] as fla's. fla's
reference L2-normalises q and k inside; this op takes them as they come (the mixer normalises them, as for the other
delta rules; fla's kernel is called with use_qk_l2norm_in_kernel=False), so on unit q, k the two agree.
A reset (`reset` [B, T]) clears both S and A before its step. The state is the pair (S, A).

The preconditioner's state does not depend on S, so the chunkwise form first runs A's scan (lm.ops.diagonal_scan) and
forms the write keys p_t = M_t * k_t; S is then the generalised delta rule S_t = (I - p_t r_t^T) alpha_t S_{t-1} +
p_t w_t^T with r = beta k and w = beta v (lm.ops.kda.generalized_delta, its form with a decay per head).
"""

import math

import torch

from lm.ops import self_check
from lm.ops.common import autocast_off, check_shapes, compute_dtype
from lm.ops.diagonal_scan import diagonal_scan, diagonal_scan_recurrent
from lm.ops.fla import CHECK_T, fla_agrees, fla_precond_delta_rule, precond_available, use_fla
from lm.ops.kda import generalized_delta, generalized_delta_recurrent

PrecondState = tuple[torch.Tensor, torch.Tensor]  # (S [B, H, K, V], A [B, H, K])


def precond_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_alpha: torch.Tensor | None,
    beta_a: torch.Tensor,
    log_alpha_a: torch.Tensor,
    scale: float = 1.0,
    *,
    squash: float = 1.5,
    eps: float = 1e-6,
    center: float | torch.Tensor = -0.2,
    initial_state: PrecondState | None = None,
    reset: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, PrecondState]:
    """Chunkwise preconditioned gated delta rule (module docstring).

    q, k: [B, T, H, K] (unit vectors, as the mixer gives them); v: [B, T, H, V]; beta, log_alpha (None: no decay),
    beta_a, log_alpha_a: [B, T, H]; center: a float or [H]; initial_state: (S [B, H, K, V], A [B, H, K]) or None
    (zeros); reset: [B, T] bool or None. Any T works. Returns (out [B, T, H, V] in q's dtype, (S, A) in float32, or
    float64 for float64 inputs).
    backend: "torch" (this code), "fla" (fla's chunk_precond_gated_delta_rule; CUDA, bf16/fp16) or "auto" (fla for CUDA
    bf16/fp16 inputs when it imports and passes its self-check, else torch).
    """
    _check(q, k, v, beta, log_alpha, beta_a, log_alpha_a, center, initial_state, reset)
    tensors = (q, k, v, beta, log_alpha, beta_a, log_alpha_a, *(initial_state or ()))
    if use_fla(backend, *tensors, op="precond_delta_rule", gated_kernel="gated_delta_rule",
               available=precond_available) \
            and _fla_agrees(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale, squash, eps, center,
                            initial_state, reset):
        return fla_precond_delta_rule(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale, squash, eps, center,
                                      initial_state, reset)
    return _forms(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale, squash, eps, center, initial_state, reset,
                  chunk_size)


def precond_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_alpha: torch.Tensor | None,
    beta_a: torch.Tensor,
    log_alpha_a: torch.Tensor,
    scale: float = 1.0,
    *,
    squash: float = 1.5,
    eps: float = 1e-6,
    center: float | torch.Tensor = -0.2,
    initial_state: PrecondState | None = None,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PrecondState]:
    """Recurrent preconditioned gated delta rule: plain loops over t, for decoding. Same arguments and results as
    `precond_delta_rule`."""
    _check(q, k, v, beta, log_alpha, beta_a, log_alpha_a, center, initial_state, reset)
    return _forms(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale, squash, eps, center, initial_state, reset)


@autocast_off()
def _forms(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale, squash, eps, center, initial_state, reset,
           chunk_size=None):
    """The chunkwise form, or with chunk_size None the recurrent one: A's scan, the preconditioned write keys, then
    the generalised delta rule."""
    dtype = compute_dtype(q)
    H, K = q.shape[2:]
    k = k.to(dtype)
    S0, A0 = (None, None) if initial_state is None else initial_state
    A_in = None if A0 is None else A0.to(dtype).flatten(1)
    writes, decays = _a_scan_inputs(k, beta_a, log_alpha_a)
    if chunk_size is None:
        A, A_T = diagonal_scan_recurrent(writes, decays, initial_state=A_in, reset=reset)
    else:
        A, A_T = diagonal_scan(writes, decays, initial_state=A_in, reset=reset, chunk_size=chunk_size, backend="torch")
    p = preconditioner(A.unflatten(2, (H, K)), squash, eps, center) * k
    beta = beta.to(dtype)[..., None]
    args = (q, beta * k, p, beta * v.to(dtype), log_alpha, scale, S0, reset)
    out, S = generalized_delta_recurrent(*args) if chunk_size is None else generalized_delta(*args, chunk_size)
    return out, (S, A_T.unflatten(1, (H, K)))


def _a_scan_inputs(k, beta_a, log_alpha_a):
    """A's recurrence as a diagonal scan over the H * K channels: (its writes beta^A_t k_t^2, its log-decays)
    [B, T, H * K], in k's dtype."""
    B, T, H, K = k.shape
    writes = beta_a.to(k.dtype)[..., None] * k * k
    return writes.flatten(2), log_alpha_a.to(k.dtype)[..., None].expand(B, T, H, K).flatten(2)


def preconditioner(A: torch.Tensor, squash: float, eps: float, center) -> torch.Tensor:
    """M = exp(-log(squash) s(log(A + eps) - center)), s(r) = r / (1 + |r|): a smooth squash of log A around the
    center into (1/squash, squash), large where A (the keys' recent energy in that channel) is small. A [..., H, K];
    center a float or [H]."""
    if torch.is_tensor(center):
        center = center.to(A.dtype)[:, None]
    r = torch.log(A + eps) - center
    return torch.exp(-math.log(squash) * r / (1 + r.abs()))


def _check(q, k, v, beta, log_alpha, beta_a, log_alpha_a, center, initial_state, reset) -> None:
    S0, A0 = (None, None) if initial_state is None else initial_state
    check_shapes(q, k, v, S0, reset=reset, beta=beta, log_alpha=log_alpha, beta_a=beta_a, log_alpha_a=log_alpha_a)
    B, _, H, K = q.shape
    if beta is None or beta_a is None or log_alpha_a is None:
        raise ValueError("precond_delta_rule: beta, beta_a and log_alpha_a are required ([B, T, H])")
    if A0 is not None and A0.shape != (B, H, K):
        raise ValueError(f"expected the initial preconditioner state A [B, H, K] = {(B, H, K)}, got {tuple(A0.shape)}")
    if (S0 is None) != (A0 is None):
        raise ValueError("precond_delta_rule: initial_state is the pair (S, A), both or neither")
    if torch.is_tensor(center) and center.shape != (H,):
        raise ValueError(f"expected center [H] = {(H,)} or a float, got {tuple(center.shape)}")


def _fla_agrees(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale, squash, eps, center, initial_state,
                reset) -> bool:
    """fla's self-check for this call's shape class: the dtypes, the head sizes, a decay or not, a center per head or
    not, an initial state and resets or not; the input as tests/test_ops_gpu.py's, smaller, with beta in [0, 2]."""
    K, V = q.shape[-1], v.shape[-1]
    dtypes = tuple(None if t is None else t.dtype for t in (q, k, v, beta, log_alpha, beta_a, log_alpha_a))
    shape_class = (dtypes, K, V, torch.is_tensor(center), squash, eps, initial_state is not None, reset is not None)

    def make_inputs(g):
        B, T, H = 1, CHECK_T, q.shape[2]
        rand = lambda t, scale=1.0: (scale * torch.rand(B, T, H, generator=g, device=g.device)).to(t.dtype)  # noqa: E731
        x = dict(
            q=self_check.unit(g, B, T, H, K, dtype=q.dtype).requires_grad_(),
            k=self_check.unit(g, B, T, H, K, dtype=k.dtype).requires_grad_(),
            v=self_check.normal(g, B, T, H, V, dtype=v.dtype).requires_grad_(),
            beta=rand(beta, 2.0).requires_grad_(),
            log_alpha=None if log_alpha is None else self_check.log_decay(g, B, T, H, dtype=log_alpha.dtype)
            .requires_grad_(),
            beta_a=rand(beta_a).requires_grad_(),
            log_alpha_a=self_check.log_decay(g, B, T, H, dtype=log_alpha_a.dtype).requires_grad_(),
            center=center.detach().clone().requires_grad_() if torch.is_tensor(center) else center,
            reset=None if reset is None else self_check.resets(B, T, q.device),
        )
        if initial_state is not None:
            x["S0"] = self_check.normal(g, B, H, K, V, scale=0.1, dtype=initial_state[0].dtype).requires_grad_()
            x["A0"] = torch.rand(B, H, K, generator=g, device=g.device).to(initial_state[1].dtype).requires_grad_()
        return x

    def run(backend):
        def call(S0=None, A0=None, **x):
            out, (S, A) = precond_delta_rule(**x, scale=scale, squash=squash, eps=eps, backend=backend,
                                             initial_state=None if S0 is None else (S0, A0))
            return dict(out=out, state=S, precond_state=A)

        return call

    return fla_agrees("precond_delta_rule", "chunk_precond_gated_delta_rule", run, make_inputs, q, shape_class,
                      "gated_delta_rule")


# ----------------------------------------------------------------------------------------------------------------------
# transfer maps (context parallelism)
#
# A piece's A ends as exp(sum of log_alpha_a) * A_in + A_from_zero, whatever S is. Its S ends as map @ S_in +
# S_from_zero, but both depend on A_in (M_t does, nonlinearly). So the exchange composes A first: each piece's
# `precond_a_transfer` (cheap, [B, H, K]) gives every piece the A it really starts from (`carry_precond_a`); each
# piece then runs `precond_transfer` from that A for its S map, and `carry_precond` composes S as for the delta rule.


def precond_a_transfer(k, beta_a, log_alpha_a, *, reset=None):
    """(A at the piece's end from A = 0 [B, H, K], log of its map [B, H]: the sum of log_alpha_a, -inf in a row with
    a reset). A's scan runs alone here (no S)."""
    dtype = compute_dtype(k)
    H, K = k.shape[2:]
    _, A_T = diagonal_scan(*_a_scan_inputs(k.to(dtype), beta_a, log_alpha_a), reset=reset, backend="torch")
    log_map = log_alpha_a.to(dtype).sum(1)
    if reset is not None:
        log_map = log_map.masked_fill(reset.any(1)[:, None], -math.inf)
    return A_T.unflatten(1, (H, K)), log_map


def carry_precond_a(initial_A, log_map, A_from_zero):
    """A at the piece's end from initial_A (None: zero)."""
    if initial_A is None:
        return A_from_zero
    return A_from_zero + log_map.exp()[..., None] * initial_A.to(A_from_zero.dtype)


def precond_transfer(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale=1.0, *, initial_A=None, squash=1.5,
                     eps=1e-6, center=-0.2, reset=None, chunk_size=64, backend="auto"):
    """((S from S = 0, A from A = 0), (S map [B, H, K, K], A's log map [B, H])) of a piece that starts with the
    preconditioner state `initial_A` (None: zero), which the S map depends on: compose A first (module comment). In
    one call of the op, K more value columns starting as the identity (v = 0 there) give the S map, as for the
    delta rule."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype = compute_dtype(q)
    eye = torch.eye(K, dtype=dtype, device=v.device)
    S_in = torch.cat([eye.new_zeros(B, H, K, V), eye.expand(B, H, K, K)], dim=-1)
    A_in = eye.new_zeros(B, H, K) if initial_A is None else initial_A
    wide_v = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    _, (S, _) = precond_delta_rule(q, k, wide_v, beta, log_alpha, beta_a, log_alpha_a, scale, squash=squash, eps=eps,
                                   center=center, initial_state=(S_in, A_in), reset=reset, chunk_size=chunk_size,
                                   backend=backend)
    A_from_zero, log_map = precond_a_transfer(k, beta_a, log_alpha_a, reset=reset)
    return (S[..., :V], A_from_zero), (S[..., V:], log_map)


def carry_precond(initial, transfer, final_from_zero):
    """(S, A) at the piece's end from initial = (S_in, A_in) (None: zeros), with the transfer that
    `precond_transfer` computed from that same A_in."""
    if initial is None:
        return final_from_zero
    (S_map, log_map), (S_zero, A_zero) = transfer, final_from_zero
    S_in, A_in = initial
    return S_zero + S_map @ S_in.to(S_map.dtype), carry_precond_a(A_in, log_map, A_zero)

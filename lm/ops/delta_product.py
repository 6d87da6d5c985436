"""Gated DeltaProduct (arXiv 2502.10297): n_h Householder steps per token, each with its own key, value and beta,
and the token's gate applied once, before its steps:

    S_{t,0} = alpha_t S_{t-1},    S_{t,j} = (I - beta_{t,j} k_{t,j} k_{t,j}^T) S_{t,j-1} + beta_{t,j} k_{t,j} v_{t,j}^T,
    S_t = S_{t,n_h},    o_t = scale * S_t^T q_t,

so the token's transition is alpha_t times a product of n_h generalised Householder matrices. alpha_t = exp(log_alpha_t)
([B, T, H]; None: 1, DeltaProduct without a gate). The layout is fla's (naive_recurrent_gated_delta_product): k, v and
beta have T * n_h rows, token t's steps at rows t * n_h .. t * n_h + n_h - 1 in order. n_h = 1 is the gated delta
rule. beta in [0, 2] gives each step an eigenvalue 1 - beta in [-1, 1] along its (unit) key (negative eigenvalues).
State S [B, H, K, V], keys along the rows, as fla's reference holds it.

Both forms are lm.ops.delta_rule over the interleaved rows, which is exact: a scalar gate commutes with I - beta k k^T,
so alpha_t on the token's first row and 1 on the others is the gate before the steps; the query sits on the token's
last row (zero elsewhere) and the output is read there; a reset (`reset` [B, T]) clears the state before the token's
first row. `chunk_size` counts rows (Householder steps), not tokens (the mixer's default, 32 rows, is faster on a
CPU than 64).
"""

import torch

from lm.ops import self_check
from lm.ops.common import check_reset, compute_dtype
from lm.ops.delta_rule import delta_rule, delta_rule_recurrent
from lm.ops.fla import CHECK_T, delta_product_available, fla_agrees, fla_delta_product, use_fla


def delta_product(
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
    """Chunkwise gated DeltaProduct.

    q: [B, T, H, K]; k: [B, T * n_h, H, K] (usually L2-normalised); v: [B, T * n_h, H, V]; beta: [B, T * n_h, H];
    log_alpha: [B, T, H] or None (no gate); initial_state: [B, H, K, V] or None (zeros); reset: [B, T] bool or None.
    Returns (out [B, T, H, V] in q's dtype, final_state [B, H, K, V] in float32, or float64 for float64 inputs).
    backend: "torch" (lm.ops.delta_rule over the rows), "fla" (fla's chunk_gated_delta_product; CUDA, bf16/fp16) or
    "auto" (fla for CUDA bf16/fp16 inputs when it imports and passes its self-check, else torch).
    """
    n_h = _check(q, k, v, beta, log_alpha, initial_state, reset)
    gated_kernel = None if log_alpha is None else "gated_delta_rule"  # fla runs its gated backward
    if use_fla(backend, q, k, v, beta, log_alpha, initial_state, op="delta_product", gated_kernel=gated_kernel,
               available=delta_product_available) \
            and _fla_agrees(q, k, v, beta, log_alpha, scale, initial_state, reset, gated_kernel):
        return fla_delta_product(q, k, v, beta, log_alpha, scale, initial_state, reset)
    rows_q, rows_log_alpha, rows_reset = _rows(q, log_alpha, reset, n_h)
    out, state = delta_rule(rows_q, k, v, beta, rows_log_alpha, scale, initial_state=initial_state, reset=rows_reset,
                            chunk_size=chunk_size, backend="torch")
    return out[:, n_h - 1::n_h], state


def delta_product_recurrent(
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
    """Recurrent gated DeltaProduct: the delta rule's per-step loop over the rows, for decoding (T = 1: the token's
    n_h steps). Same arguments and results as `delta_product`."""
    n_h = _check(q, k, v, beta, log_alpha, initial_state, reset)
    rows_q, rows_log_alpha, rows_reset = _rows(q, log_alpha, reset, n_h)
    out, state = delta_rule_recurrent(rows_q, k, v, beta, rows_log_alpha, scale, initial_state=initial_state,
                                      reset=rows_reset)
    return out[:, n_h - 1::n_h], state


def _check(q, k, v, beta, log_alpha, initial_state, reset) -> int:
    """The shapes of the module docstring; returns n_h."""
    B, T, H, K = q.shape
    rows = k.shape[1]
    if k.dim() != 4 or T == 0 or rows % T or k.shape != (B, rows, H, K) or v.dim() != 4 \
            or v.shape[:3] != (B, rows, H) or beta.shape != (B, rows, H):
        raise ValueError(f"expected q [B, T, H, K], and k [B, T * n_h, H, K], v [B, T * n_h, H, V], beta "
                         f"[B, T * n_h, H]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, beta "
                         f"{tuple(beta.shape)}")
    if log_alpha is not None and log_alpha.shape != (B, T, H):
        raise ValueError(f"expected log_alpha [B, T, H] = {(B, T, H)}, got {tuple(log_alpha.shape)}")
    check_reset(reset, B, T)
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"expected initial_state [B, H, K, V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}")
    return rows // T


def _rows(q, log_alpha, reset, n_h):
    """The token-wise inputs on the rows: q on each token's last row, the gate and the reset on its first, zeros (and
    no reset) elsewhere."""

    def on_row(x, row, fill=0):
        if x is None or n_h == 1:
            return x
        other = torch.full_like(x, fill)
        return torch.stack([x if j == row else other for j in range(n_h)], dim=2).flatten(1, 2)

    return on_row(q, n_h - 1), on_row(log_alpha, 0), on_row(reset, 0, False)


def _fla_agrees(q, k, v, beta, log_alpha, scale, initial_state, reset, gated_kernel) -> bool:
    """fla's self-check for this call's shape class: the dtypes, the head sizes, n_h, gated or not, an initial state
    and resets or not; the input as tests/test_ops_gpu.py's, smaller, with beta in [0, 2]."""
    K, V, n_h = q.shape[-1], v.shape[-1], k.shape[1] // q.shape[1]
    dtypes = tuple(None if t is None else t.dtype for t in (q, k, v, beta, log_alpha, initial_state))
    shape_class = (dtypes, K, V, n_h, reset is not None)

    def make_inputs(g):
        B, T, H = 1, CHECK_T, 2
        return dict(
            q=self_check.normal(g, B, T, H, K, dtype=q.dtype).requires_grad_(),
            k=self_check.unit(g, B, T * n_h, H, K, dtype=k.dtype).requires_grad_(),
            v=self_check.normal(g, B, T * n_h, H, V, dtype=v.dtype).requires_grad_(),
            beta=(2 * torch.rand(B, T * n_h, H, generator=g, device=g.device)).to(beta.dtype).requires_grad_(),
            log_alpha=None if log_alpha is None else self_check.log_decay(g, B, T, H, dtype=log_alpha.dtype)
            .requires_grad_(),
            initial_state=None if initial_state is None else self_check.normal(
                g, B, H, K, V, scale=0.1, dtype=initial_state.dtype).requires_grad_(),
            reset=None if reset is None else self_check.resets(B, T, q.device),
        )

    def run(backend):
        def call(**x):
            out, state = delta_product(**x, scale=scale, backend=backend)
            return dict(out=out, state=state)

        return call

    return fla_agrees("delta_product", "chunk_gated_delta_product", run, make_inputs, q, shape_class, gated_kernel)


def delta_product_transfer(q, k, v, beta, log_alpha=None, scale=1.0, *, reset=None, chunk_size=64, backend="auto"):
    """(final state from zero [B, H, K, V], map [B, H, K, K]) of a DeltaProduct piece, for context parallelism: its
    final state from `initial` is final_from_zero + map @ initial (`carry_delta_product`). As for the delta rule, K
    more value columns that start as the identity and are written v = 0 end as the product of the transitions."""
    B, rows, H, K = k.shape
    V = v.shape[-1]
    eye = torch.eye(K, dtype=compute_dtype(q), device=v.device)
    initial = torch.cat([eye.new_zeros(B, H, K, V), eye.expand(B, H, K, K)], dim=-1)
    wide_v = torch.cat([v, v.new_zeros(B, rows, H, K)], dim=-1)
    _, final = delta_product(q, k, wide_v, beta, log_alpha, scale, initial_state=initial, reset=reset,
                             chunk_size=chunk_size, backend=backend)
    return final[..., :V], final[..., V:]


def carry_delta_product(initial, transfer: torch.Tensor, final_from_zero: torch.Tensor):
    """final_from_zero + transfer @ initial per head (initial None: the zero state)."""
    if initial is None:
        return final_from_zero
    return final_from_zero + transfer @ initial.to(transfer.dtype)

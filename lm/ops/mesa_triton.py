"""Mesa's chunkwise solve as Triton kernels: the fast path of `lm.ops.mesa.mesa(..., backend="triton")`.

The state entering each chunk depends on the keys (and values) only, so it is computed once per solve
(`chunk_entry_states`, a short sequential pass over chunks per (batch, head)). Then every (batch, head, chunk) solves
its tokens' systems (H_t + diag(lam)) x_t = b_t on its own (`chunk_solve`): all CG iterations in one program, the
chunk's keys, decays and entering state held on chip, in fp32 (fp64 for fp64 inputs) whatever the input dtype. With
the chunk's cumulative log-decays c_i, its entering state H_n and its per-token masks (see `ChunkDocuments`),

    H_i p_i = sum_{j <= i, same document} exp(c_i - c_j) beta_j (p_i . k_j) k_j + [no reset up to i] exp(c_i) H_n p_i,

which is two small matmuls through the chunk's [C, C] decay matrix and one through H_n. The forward program ends with
the readout o_i = G_i x_i (the same sums with the values); the adjoint program starts by forming its right-hand side
G_i^T do_i the same way. CG is `lm.ops.mesa._cg` step for step: the Jacobi warm start, a frozen token takes zero
steps, and with a tolerance a program stops as soon as all its tokens have converged, with no host sync.

The plain reference beside these kernels is the torch code in lm/ops/mesa.py; tests run both under
TRITON_INTERPRET=1 on the CPU (tests/test_op_mesa_triton.py).

Triton >= 3.4 and < 3.7.1 miscompile a transposed dot result fed into another `tl.dot` on Hopper (fla's issue #640):
no kernel here transposes a dot's result; the only transposes are of loaded (or elementwise-scaled) operands.
"""

import torch
import triton
import triton.language as tl

# fp32 products through three TF32 passes: fp32 accuracy on tensor cores (plain TF32 would cost the solve ~1e-3).
_PRECISION = {torch.float32: "tf32x3", torch.float64: "ieee"}
_TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64}


# A program holds its chunk's keys and entering state on chip, so its shared memory grows with K, V and the chunk; past
# these sizes, or at K = V = 128 with a chunk of 64, it asks for more than an SM has
# (`python -m lm.bench.kernel_resources` compiles the kernels for sm_90 and says how much; docs/performance.md).
MAX_K, MAX_V = 128, 256


def block(n: int) -> int:
    """A power-of-two block of at least 16 (tl.dot's smallest) that holds n."""
    return max(16, triton.next_power_of_2(n))


def unsupported(K: int, V: int) -> str | None:
    """Why the kernels cannot take these head sizes, or None."""
    if K > MAX_K or V > MAX_V:
        return (f"the Triton kernels take K <= {MAX_K} and V <= {MAX_V} (a program's state must fit on chip), got "
                f"K={K}, V={V}")
    return None


def solve_warps(K: int, V: int) -> int:
    """Warps per solve program: 8 for heads above 64 (fewer registers spilled per thread)."""
    return 8 if max(K, V) > 64 else 4


def kernel_chunk(chunk_size: int, K: int, V: int) -> int:
    """The chunk the kernels run: chunk_size rounded up to a power of two (at least 16), and at most 64, or 32 where K
    or V is above 64 (see MAX_K). The chunk changes how the work is split, not the result."""
    return min(block(chunk_size), 64 if max(K, V) <= 64 else 32)


@triton.jit
def _chunk_gates(lg_ptr, beta_ptr, reset_ptr, b, h, n, T, H, C: tl.constexpr, HAS_RESET: tl.constexpr,
                 DTYPE: tl.constexpr):
    """One chunk's gates: cumulative log-decays c [C], beta [C] (0 past T), document index doc [C] (resets up to and
    including each step, within the chunk) and the token mask."""
    t = n * C + tl.arange(0, C)
    valid = t < T
    lg = tl.load(lg_ptr + (b * T + t) * H + h, mask=valid, other=0.0).to(DTYPE)
    beta = tl.load(beta_ptr + (b * T + t) * H + h, mask=valid, other=0.0).to(DTYPE)
    if HAS_RESET:
        doc = tl.cumsum(tl.load(reset_ptr + b * T + t, mask=valid, other=0).to(tl.int32), 0)
    else:
        doc = tl.zeros([C], dtype=tl.int32)
    return tl.cumsum(lg, 0), beta, doc, t, valid


@triton.jit
def _entry_states_kernel(k_ptr, r_ptr, lg_ptr, beta_ptr, reset_ptr, s0_ptr, entering_ptr, final_ptr,
                         T, H, R, K, N,
                         C: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, HAS_RESET: tl.constexpr,
                         DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """S_{n+1} = decay_n S_n + sum_j to_end_j beta_j r_j k_j^T over chunks n, for rows [BR] of S [R, K] (r = v for G,
    r = k for H). Writes S_n (the state entering chunk n) for every n, and the final state."""
    row_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = row_block * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    state_mask = (rows[:, None] < R) & (cols[None, :] < K)
    state_offsets = rows[:, None] * K + cols[None, :]
    state = tl.load(s0_ptr + bh * R * K + state_offsets, mask=state_mask, other=0.0).to(DTYPE)
    n = 0
    while n < N:  # not range(N): Triton 3.6's interpreter cannot take a runtime bound there under NumPy 2
        tl.store(entering_ptr + (bh * N + n) * R * K + state_offsets, state, mask=state_mask)
        c, beta, doc, t, valid = _chunk_gates(lg_ptr, beta_ptr, reset_ptr, b, h, n, T, H, C, HAS_RESET, DTYPE)
        last = tl.sum(tl.where(t == n * C + C - 1, c, 0.0), 0)
        last_doc = tl.max(doc, 0)
        to_end = tl.where(doc == last_doc, tl.exp(last - c), 0.0) * beta
        decay = tl.where(last_doc == 0, tl.exp(last), 0.0)
        token_rows = (b * T + t[:, None]) * H + h
        keys = tl.load(k_ptr + token_rows * K + cols[None, :], mask=valid[:, None] & (cols[None, :] < K),
                       other=0.0).to(DTYPE)
        rs = tl.load(r_ptr + token_rows * R + rows[None, :], mask=valid[:, None] & (rows[None, :] < R),
                     other=0.0).to(DTYPE)
        state = decay * state + tl.dot(tl.trans(rs * to_end[:, None]), keys, input_precision=PRECISION)
        n += 1
    tl.store(final_ptr + bh * R * K + state_offsets, state, mask=state_mask)


@triton.jit
def _solve_kernel(rhs_ptr, k_ptr, v_ptr, lg_ptr, beta_ptr, reset_ptr, lam_ptr, g_ptr, h_ptr,
                  x_ptr, out_ptr, iterations_ptr, residual_ptr, diag_ptr,
                  T, H, K, V, N, steps, tol_sq,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ADJOINT: tl.constexpr,
                  HAS_RESET: tl.constexpr, HAS_TOL: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One (chunk, batch x head): solve (H_i + diag(lam)) x_i = b_i for the chunk's tokens by warm-started CG.
    Forward (ADJOINT False): b = q (rhs_ptr), and the readout o_i = G_i x_i is written to out_ptr. Adjoint: rhs_ptr
    is do [.., V] and b_i = G_i^T do_i. Writes x, and per token the CG steps taken and the true relative residual,
    and per program the largest diag(H_i)."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    c, beta, doc, t, valid = _chunk_gates(lg_ptr, beta_ptr, reset_ptr, b, h, n, T, H, C, HAS_RESET, DTYPE)
    # The decay matrix exp(c_i - c_j) beta_j (j <= i, one document) and the entering state's decay to step i.
    i_idx, j_idx = tl.arange(0, C)[:, None], tl.arange(0, C)[None, :]
    same = (j_idx <= i_idx) & (doc[:, None] == doc[None, :])
    weights = tl.exp(tl.where(same, c[:, None] - c[None, :], float("-inf"))) * beta[None, :]
    from_start = tl.where(doc == 0, tl.exp(c), 0.0)[:, None]

    kc, vc = tl.arange(0, BK), tl.arange(0, BV)
    token_rows = (b * T + t[:, None]) * H + h
    k_mask, v_mask = valid[:, None] & (kc[None, :] < K), valid[:, None] & (vc[None, :] < V)
    keys = tl.load(k_ptr + token_rows * K + kc[None, :], mask=k_mask, other=0.0).to(DTYPE)
    # H_n^T ([K, K], loaded transposed) so that the row vectors p_i^T give (H_n p_i)^T = p_i^T H_n^T.
    h_base = h_ptr + (bh * N + n) * K * K
    state_mask = (kc[:, None] < K) & (kc[None, :] < K)
    h_t = tl.load(h_base + kc[None, :] * K + kc[:, None], mask=state_mask, other=0.0)
    lam = tl.load(lam_ptr + h * K + kc, mask=kc < K, other=1.0).to(DTYPE)[None, :]  # 1 in padding: no 0/0
    g_base = g_ptr + (bh * N + n) * V * K
    g_mask = (vc[:, None] < V) & (kc[None, :] < K)

    if ADJOINT:  # b_i = G_i^T do_i = sum_j w_ij (do_i . v_j) k_j + from_start_i G_n^T do_i
        d_out = tl.load(rhs_ptr + token_rows * V + vc[None, :], mask=v_mask, other=0.0).to(DTYPE)
        values = tl.load(v_ptr + token_rows * V + vc[None, :], mask=v_mask, other=0.0).to(DTYPE)
        g = tl.load(g_base + vc[:, None] * K + kc[None, :], mask=g_mask, other=0.0)  # G_n [V, K]
        scores = tl.dot(d_out, tl.trans(values), input_precision=PRECISION) * weights
        rhs = tl.dot(scores, keys, input_precision=PRECISION)
        rhs += tl.dot(d_out * from_start, g, input_precision=PRECISION)
    else:
        rhs = tl.load(rhs_ptr + token_rows * K + kc[None, :], mask=k_mask, other=0.0).to(DTYPE)

    diag_h = tl.dot(weights, keys * keys, input_precision=PRECISION)
    diag_h += from_start * tl.load(h_base + kc * (K + 1), mask=kc < K, other=0.0)[None, :]
    tl.store(diag_ptr + bh * N + n, tl.max(tl.max(diag_h, 1), 0))

    # CG, as lm.ops.mesa._cg; matvec(p) = (H_i + diag(lam)) p_i for every token of the chunk.
    x = rhs / (diag_h + lam)
    r = rhs - _matvec(x, keys, weights, from_start, h_t, lam, PRECISION)
    p = r
    rs_old = tl.sum(r * r, 1)
    threshold = tol_sq * rs_old
    active = rs_old > threshold
    iterations = tl.zeros([C], dtype=DTYPE)
    step = 0
    # Without a tolerance every token takes all the steps (as the torch code does); with one, the chunk stops
    # when all its tokens have converged.
    remaining = tl.sum(active.to(tl.int32), 0)
    if not HAS_TOL:
        remaining = remaining * 0 + 1
    while (step < steps) & (remaining > 0):
        ap = _matvec(p, keys, weights, from_start, h_t, lam, PRECISION)
        p_ap = tl.sum(p * ap, 1)
        ok = active & (p_ap > 0)
        alpha = tl.where(ok, rs_old / tl.where(ok, p_ap, 1.0), 0.0)
        x += alpha[:, None] * p
        r -= alpha[:, None] * ap
        rs_new = tl.sum(r * r, 1)
        cg_beta = tl.where(rs_old > 0, rs_new / tl.where(rs_old > 0, rs_old, 1.0), 0.0)
        p = r + cg_beta[:, None] * p
        if HAS_TOL:
            iterations += active.to(DTYPE)
            active = active & (rs_new > threshold)
            remaining = tl.sum(active.to(tl.int32), 0)
        else:
            iterations += 1.0
        rs_old = rs_new
        step += 1

    # What the solve achieved: the true residual ||b - A x|| / ||b|| (0 where b = 0).
    true_r = rhs - _matvec(x, keys, weights, from_start, h_t, lam, PRECISION)
    norm_b = tl.sqrt(tl.sum(rhs * rhs, 1))
    residual = tl.where(norm_b > 0, tl.sqrt(tl.sum(true_r * true_r, 1)) / tl.where(norm_b > 0, norm_b, 1.0), 0.0)
    tl.store(iterations_ptr + bh * T + t, iterations, mask=valid)
    tl.store(residual_ptr + bh * T + t, residual, mask=valid)
    tl.store(x_ptr + token_rows * K + kc[None, :], x, mask=k_mask)

    if not ADJOINT:  # o_i = G_i x_i = sum_j w_ij (x_i . k_j) v_j + from_start_i G_n x_i
        values = tl.load(v_ptr + token_rows * V + vc[None, :], mask=v_mask, other=0.0).to(DTYPE)
        g_t = tl.load(g_base + vc[None, :] * K + kc[:, None], mask=(kc[:, None] < K) & (vc[None, :] < V),
                      other=0.0)  # G_n^T [K, V]
        out = tl.dot(tl.dot(x, tl.trans(keys), input_precision=PRECISION) * weights, values,
                     input_precision=PRECISION)
        out += tl.dot(x * from_start, g_t, input_precision=PRECISION)
        tl.store(out_ptr + token_rows * V + vc[None, :], out, mask=v_mask)


@triton.jit
def _matvec(p, keys, weights, from_start, h_t, lam, PRECISION: tl.constexpr):
    """(H_i + diag(lam)) p_i for the chunk's row vectors p [C, BK]."""
    intra = tl.dot(tl.dot(p, tl.trans(keys), input_precision=PRECISION) * weights, keys, input_precision=PRECISION)
    return intra + tl.dot(p * from_start, h_t, input_precision=PRECISION) + lam * p


def _gates(log_gamma, beta, reset):
    """Contiguous gates, and reset as int8 (or a placeholder pointer when there is none)."""
    reset_arg = reset.to(torch.int8).contiguous() if reset is not None else log_gamma
    return log_gamma.contiguous(), beta.contiguous(), reset_arg


def chunk_entry_states(k, rows, log_gamma, beta, initial, reset, chunk: int, dtype: torch.dtype):
    """The state S [B, H, R, K] entering every chunk, S_{t} = gamma_t S_{t-1} + beta_t r_t k_t^T (r = rows: v for
    G, k for H), from `initial` [B, H, R, K]: returns (entering [B, H, N, R, K], final [B, H, R, K]) in `dtype`."""
    B, T, H, K = k.shape
    R = rows.shape[-1]
    N = triton.cdiv(T, chunk)
    entering = k.new_empty(B, H, N, R, K, dtype=dtype)
    final = k.new_empty(B, H, R, K, dtype=dtype)
    log_gamma, beta, reset_arg = _gates(log_gamma, beta, reset)
    BR = min(block(R), 64)
    _entry_states_kernel[(triton.cdiv(R, BR), B * H)](
        k.contiguous(), rows.contiguous(), log_gamma, beta, reset_arg, initial.to(dtype).contiguous(), entering, final,
        T, H, R, K, N, C=chunk, BR=BR, BK=block(K), HAS_RESET=reset is not None, DTYPE=_TL_DTYPE[dtype],
        PRECISION=_PRECISION[dtype], num_warps=4)
    return entering, final


def chunk_solve(rhs, k, v, log_gamma, beta, lam, G_entering, H_entering, reset, chunk: int, steps: int,
                tol: float | None, adjoint: bool, out_dtype: torch.dtype):
    """Solve (H_t + diag(lam)) x_t = b_t for every token and head, one program per (chunk, batch x head).

    Forward (adjoint=False): b = rhs = q [B, T, H, K]; returns (x, out = G_t x_t [B, T, H, V] in out_dtype, stats).
    Adjoint: rhs = do [B, T, H, V] and b_t = G_t^T do_t; returns (x, None, stats). x is in the entering states'
    dtype; stats = (iterations [B, H, T], true relative residual [B, H, T], largest diag(H_t) per program)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = G_entering.shape[2]
    dtype = H_entering.dtype
    x = k.new_empty(B, T, H, K, dtype=dtype)
    out = None if adjoint else k.new_empty(B, T, H, V, dtype=out_dtype)
    iterations = k.new_empty(B, H, T, dtype=dtype)
    residual = k.new_empty(B, H, T, dtype=dtype)
    diag = k.new_empty(B, H, N, dtype=dtype)
    log_gamma, beta, reset_arg = _gates(log_gamma, beta, reset)
    _solve_kernel[(N, B * H)](
        rhs.contiguous(), k.contiguous(), v.contiguous(), log_gamma, beta, reset_arg, lam.contiguous(), G_entering,
        H_entering, x, x if out is None else out, iterations, residual, diag,
        T, H, K, V, N, steps, 0.0 if tol is None else tol**2,
        C=chunk, BK=block(K), BV=block(V), ADJOINT=adjoint, HAS_RESET=reset is not None, HAS_TOL=tol is not None,
        DTYPE=_TL_DTYPE[dtype], PRECISION=_PRECISION[dtype], num_warps=solve_warps(K, V))
    return x, out, (iterations, residual, diag)

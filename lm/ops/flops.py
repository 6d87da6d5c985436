"""FLOPs of each op's chunkwise form per (padded) token and head (a multiply-add counts 2), with the shapes the torch
path uses: intra-chunk products are full C x C blocks (masked afterwards). Only matrix products and triangular solves
count, as FlopCounterMode counts them (tests/test_flops.py); elementwise work does not. accounting.flops adds the
mixers' projections and sums over a model."""

import math


def padding_factor(seq_len: int, chunk: int) -> float:
    """Tokens a chunkwise op computes per real token: T padded up to a multiple of the chunk, over T."""
    return math.ceil(seq_len / chunk) * chunk / seq_len


def linear_attention_op_flops(chunk: int, k: int, v: int) -> float:
    """Per (padded) token and head: scores q k^T and scores @ v within the chunk (2C(K + V)), the chunk's write
    k^T v to the state and the read of the entering state by q (4KV)."""
    return 2 * chunk * (k + v) + 4 * k * v


def gla_op_flops(chunk: int, k: int, v: int, sub_chunk: int) -> float:
    """linear_attention with a per-key decay (GLA), per (padded) token and head; `chunk` is the chunk length the op
    uses (a multiple of sub_chunk). Queries against keys of earlier sub-chunks of the chunk, one [c, i c] product
    per sub-chunk i (c^2 K M (M - 1) per chunk of M = C / c sub-chunks: (C - c) K per token; the diagonal sub-chunks
    are elementwise, not counted), the full C x C scores @ v (2CV), and the state write and read (4KV)."""
    return (chunk - sub_chunk) * k + 2 * chunk * v + 4 * k * v


def gla_op_train_flops(chunk: int, k: int, v: int, sub_chunk: int, n_chunks: int,
                       learned_initial_state: bool = False) -> float:
    """Forward + backward with a loss on the outputs only: 3x the forward (both operands of every product depend on
    q, k or v), except with a single chunk. Its state write k^T v (one product over all chunks) then feeds only the
    final state, which no loss reads, so its backward (4KV per token) is skipped; and its queries read the initial
    state alone, whose gradient (2KV) is taken only if it is learned (training windows start from none). With more
    chunks the states are read in one product over all of them, whose gradient is taken whole."""
    skipped = (4 + (0 if learned_initial_state else 2)) * k * v if n_chunks == 1 else 0
    return 3 * gla_op_flops(chunk, k, v, sub_chunk) - skipped


def diagonal_scan_op_flops() -> float:
    """diagonal_scan has no matrix product, only elementwise work (multiply-adds, exp, cumsum), which FlopCounterMode
    does not count: 0, forward and backward."""
    return 0


def unit_lower_inverse_flops(chunk: int) -> float:
    """(I + A)^{-1} of one C x C chunk as delta_rule's UnitLowerInverse forms it: by halves, T21 = -T22 (A21 T11) with
    two products, down to blocks of at most 16, each a unit-triangular solve against the identity (C(C - 1) per
    column)."""
    if chunk <= 16:
        return chunk * (chunk - 1) * chunk
    h = chunk // 2
    rest = chunk - h
    return unit_lower_inverse_flops(h) + unit_lower_inverse_flops(rest) + 2 * rest * h * h + 2 * rest * rest * h


def delta_rule_op_flops(chunk: int, k: int, v: int) -> float:
    """Per (padded) token and head: k k^T (2CK), the chunk's (I + A)^{-1} (unit_lower_inverse_flops / C), W and U~ from
    it (2C(K + V)), q k^T and scores @ u (2C(K + V)), and three K x V products with the state: W S, the write k^T u
    and the read q S (6KV)."""
    return 2 * chunk * k + unit_lower_inverse_flops(chunk) / chunk + 4 * chunk * (k + v) + 6 * k * v


def delta_rule_op_train_flops(chunk: int, k: int, v: int, n_chunks: int) -> float:
    """3x the forward, except (1) the inverse: its backward is two C x C products (4C^2 per token), not twice its
    forward; and (2) the per-chunk state products of the sequential pass that need no gradient: the first chunk's
    W S has none for the zero initial state (2CKV) and the last chunk's write k^T u feeds only the final state, which
    no loss reads (4CKV), i.e. 6KV / n_chunks per padded token."""
    inverse = unit_lower_inverse_flops(chunk) / chunk
    return 3 * (delta_rule_op_flops(chunk, k, v) - inverse) + inverse + 4 * chunk * chunk - 6 * k * v / n_chunks


def mlstm_op_flops(chunk: int, k: int, v: int) -> float:
    """Linear attention's products plus the normaliser's read n^T q (2K); its write and the row sums of the
    gated scores are reductions, not counted."""
    return linear_attention_op_flops(chunk, k, v) + 2 * k


def _mesa_parts(chunk: int, k: int, v: int) -> tuple[float, float, float]:
    """Per (padded) token and head: the key-state set-up (each chunk's k^T k, 2K^2, and diag(H_t) by the decay
    weights times k^2, 2CK), one CG matvec H_t p_t (p k^T and its product with k, 4CK, and the entering state, 2K^2:
    the state is computed once per solve) and the readout G_t x_t (linear attention)."""
    return 2 * k * k + 2 * chunk * k, 4 * chunk * k + 2 * k * k, linear_attention_op_flops(chunk, k, v)


def mesa_cg_step_flops(chunk: int, k: int) -> float:
    """One CG step per (padded) token and head: its matvec (the dot products and vector updates are not counted)."""
    return _mesa_parts(chunk, k, k)[1]


def mesa_op_flops(chunk: int, k: int, v: int, cg_steps: int) -> float:
    """Per (padded) token and head: the key state, cg_steps + 2 matvecs (one for the starting residual, one for the
    true residual that the Mesa mixer's telemetry asks for) and the readout. cg_steps = 0 is the readout alone (plus
    H_T, 2K^2 per real token, added by `op_flops`)."""
    if cg_steps == 0:
        return linear_attention_op_flops(chunk, k, v)
    setup, matvec, readout = _mesa_parts(chunk, k, v)
    return setup + (cg_steps + 2) * matvec + readout


def mesa_op_train_flops(chunk: int, k: int, v: int, cg_steps: int) -> float:
    """Forward + backward per (padded) token and head. The backward (lm/ops/mesa.py) is the right-hand side G_t^T do_t
    (a linear attention), the key state again and the adjoint CG solve, then the surrogate: the readouts G_t x and
    H_t x recomputed and differentiated with x held constant, which skips the query gradient of q k^T (2CK each).
    The adjoint solve measures its true residual too."""
    if cg_steps == 0:
        return 3 * mesa_op_flops(chunk, k, v, 0)
    setup, matvec, readout = _mesa_parts(chunk, k, v)
    solve = setup + (cg_steps + 2) * matvec
    key_readout = linear_attention_op_flops(chunk, k, k)
    surrogate = 3 * (readout + key_readout) - 2 * (2 * chunk * k)
    return mesa_op_flops(chunk, k, v, cg_steps) + readout + solve + surrogate

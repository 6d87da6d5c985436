"""FLOPs of each op's chunkwise form per (padded) token and head (a multiply-add counts 2), with the shapes the torch
path uses: intra-chunk products are full C x C blocks (masked afterwards). Only matrix products and triangular solves
count, as FlopCounterMode counts them (tests/test_flops.py); elementwise work does not. accounting.flops adds the
mixers' projections and sums over a model.

`COSTS` finds an op's count by its name for a mixer's `OpCall` (lm.ops.call): FLOPs per token of all its heads, as
planned and, where the work depends on the data (Mesa stopped by a tolerance), as run; what a plan should say about
the count; and the working memory the op holds beyond what autograd saves."""

import dataclasses
import math
from collections.abc import Callable

from lm.ops.call import OpCall
from lm.ops.common import effective_chunk_size


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
    no loss reads (4CKV), i.e. 6KV / n_chunks per padded token; with a single chunk, also the gradient of the state
    its queries read (2KV: the zero initial state alone, as GLA's)."""
    inverse = unit_lower_inverse_flops(chunk) / chunk
    return (3 * (delta_rule_op_flops(chunk, k, v) - inverse) + inverse + 4 * chunk * chunk
            - _no_grad_state_products(k, v, n_chunks))


def _no_grad_state_products(k: int, v: int, n_chunks: int) -> float:
    """The delta rules' state products per padded token whose backward is not taken (delta_rule_op_train_flops)."""
    return 6 * k * v / n_chunks + (2 * k * v if n_chunks == 1 else 0)


def kda_op_flops(chunk: int, k: int, v: int, sub_chunk: int) -> float:
    """KDA (lm.ops.kda) with a decay per key channel, per (padded) token and head; `chunk` is the chunk length the op
    uses (a multiple of sub_chunk). The delta rule's products, except that the two C x C products with the keys (A,
    the erase keys against the keys, and the scores) are decayed per channel as GLA's: against earlier sub-chunks one
    product per sub-chunk for both at once (2(C - c)K), the diagonal sub-chunks elementwise (not counted). Then (I +
    A)^{-1}, W and U~ (2C(K + V)), scores @ u (2CV) and the three state products (6KV). With a decay per head the op
    does the delta rule's products: delta_rule_op_flops."""
    return (2 * (chunk - sub_chunk) * k + unit_lower_inverse_flops(chunk) / chunk + 2 * chunk * k + 4 * chunk * v
            + 6 * k * v)


def kda_op_train_flops(chunk: int, k: int, v: int, sub_chunk: int, n_chunks: int) -> float:
    """As delta_rule_op_train_flops: 3x the forward except the inverse (its backward is two C x C products) and the
    state products that need no gradient (6KV / n_chunks, and 2KV more with a single chunk)."""
    inverse = unit_lower_inverse_flops(chunk) / chunk
    return (3 * (kda_op_flops(chunk, k, v, sub_chunk) - inverse) + inverse + 4 * chunk * chunk
            - _no_grad_state_products(k, v, n_chunks))


def delta_product_op_flops(chunk: int, k: int, v: int, n_h: int) -> float:
    """Gated DeltaProduct (lm.ops.delta_product) per token and head: the delta rule over its n_h rows (`chunk` counts
    rows; the rows are padded to a whole number of chunks). The queries on the rows between a token's last ones are
    zeros, but the products are full."""
    return n_h * delta_rule_op_flops(chunk, k, v)


def delta_product_op_train_flops(chunk: int, k: int, v: int, n_h: int, n_chunks: int) -> float:
    """Forward + backward: the delta rule's over the rows (n_chunks: chunks of rows)."""
    return n_h * delta_rule_op_train_flops(chunk, k, v, n_chunks)


def precond_delta_rule_op_flops(chunk: int, k: int, v: int) -> float:
    """The preconditioned delta rule (lm.ops.precond_delta_rule): the delta rule's products, the erase keys against
    the preconditioned write keys instead of the keys against themselves; its preconditioner's scan is elementwise."""
    return delta_rule_op_flops(chunk, k, v)


def precond_delta_rule_op_train_flops(chunk: int, k: int, v: int, n_chunks: int) -> float:
    """Forward + backward: as the delta rule's."""
    return delta_rule_op_train_flops(chunk, k, v, n_chunks)


def mlstm_op_flops(chunk: int, k: int, v: int) -> float:
    """Linear attention's products plus the normaliser's read n^T q (2K); its write and the row sums of the
    gated scores are reductions, not counted."""
    return linear_attention_op_flops(chunk, k, v) + 2 * k


def _mesa_parts(chunk: int, k: int, v: int) -> tuple[float, float, float]:
    """Per (padded) token and head: the key-state set-up (each chunk's k^T k, 2K^2, and diag(H_t) by the decay
    weights times k^2, 2CK), one CG matvec H_t p_t (p k^T and its product with k, 4CK, and the entering state, 2K^2:
    the state is computed once per solve) and the readout G_t x_t (linear attention)."""
    return 2 * k * k + 2 * chunk * k, 4 * chunk * k + 2 * k * k, linear_attention_op_flops(chunk, k, v)


def mesa_cg_vector_flops(k: int, cg_steps: int) -> float:
    """CG's vector work per (padded) token and head for one solve (lm.ops.mesa._cg): the Jacobi start b / (diag(H) +
    lam) and the starting residual's subtraction and norm (5K), then each step's two dot products p.Ap and r.r (4K)
    and its three updates of x, r and p (6K). Unlike an elementwise gate, it grows with the steps."""
    return 5 * k + 10 * k * cg_steps


def mesa_cg_step_flops(chunk: int, k: int) -> float:
    """One CG step per (padded) token and head: its matvec and its vector work."""
    return _mesa_parts(chunk, k, k)[1] + mesa_cg_vector_flops(k, 1) - mesa_cg_vector_flops(k, 0)


def mesa_solve_flops(chunk: int, k: int, cg_steps: int) -> float:
    """One solve per (padded) token and head: the key state, cg_steps + 1 matvecs (one for the starting residual) and
    CG's vector work. The true residual that the Mesa mixer's telemetry measures after a solve (one more matvec) is
    not the model's work and is not charged."""
    setup, matvec, _ = _mesa_parts(chunk, k, k)
    return setup + (cg_steps + 1) * matvec + mesa_cg_vector_flops(k, cg_steps)


def mesa_op_flops(chunk: int, k: int, v: int, cg_steps: int) -> float:
    """Per (padded) token and head: the solve and the readout. cg_steps = 0 is the readout alone (plus H_T, 2K^2 per
    real token, added by `op_flops`)."""
    if cg_steps == 0:
        return linear_attention_op_flops(chunk, k, v)
    return mesa_solve_flops(chunk, k, cg_steps) + _mesa_parts(chunk, k, v)[2]


def mesa_op_train_flops(chunk: int, k: int, v: int, cg_steps: int) -> float:
    """Forward + backward per (padded) token and head. The backward (lm/ops/mesa.py) is the right-hand side G_t^T do_t
    (a linear attention), the key state again and the adjoint CG solve, then the surrogate: the readouts G_t x and
    H_t x recomputed and differentiated with x held constant, which skips the query gradient of q k^T (2CK each)."""
    if cg_steps == 0:
        return 3 * mesa_op_flops(chunk, k, v, 0)
    readout = _mesa_parts(chunk, k, v)[2]
    key_readout = linear_attention_op_flops(chunk, k, k)
    surrogate = 3 * (readout + key_readout) - 2 * (2 * chunk * k)
    return mesa_op_flops(chunk, k, v, cg_steps) + readout + mesa_solve_flops(chunk, k, cg_steps) + surrogate


# Plans only (`expected_cg_steps`): the factor by which CG's relative residual is taken to fall per step. On the inputs
# of docs/performance.md ("Mesa: CG steps and cost") 1e-4 took about 6 steps (0.2 a step); docs/mesa.md sets it
# against what the CPU ladder's runs spent.
PLANNED_CG_RATE = 0.2


def expected_cg_steps(cg_steps: int, cg_tol: float | None) -> int:
    """The CG steps a plan charges: cg_steps, or with cg_tol the steps at which a residual falling by PLANNED_CG_RATE
    per step reaches cg_tol (at most cg_steps). An estimate; a run counts what it ran."""
    if cg_tol is None or cg_steps == 0:
        return cg_steps
    return min(cg_steps, max(1, math.ceil(math.log(cg_tol) / math.log(PLANNED_CG_RATE))))


def _heads(call: OpCall, seq_len: int) -> tuple[int, int, int, int, float]:
    """(heads, K, V, chunk, padding factor) of a call whose first input is q [B, T, H, K] and third v [B, T, H, V]."""
    q, v = call.args[0], call.args[2]
    chunk = effective_chunk_size(call.options.get("chunk_size", 64), seq_len)
    return q.shape[2], q.shape[-1], v.shape[-1], chunk, padding_factor(seq_len, chunk)


def _linear_attention(call: OpCall, seq_len: int, training: bool) -> float:
    """A scalar decay: 3x the forward when training. A per-key decay (GLA): at the chunk the op uses, a whole number
    of sub-chunks."""
    heads, k, v, chunk, _ = _heads(call, seq_len)
    if call.args[3].dim() == 3:
        return (3 if training else 1) * heads * padding_factor(seq_len, chunk) * linear_attention_op_flops(chunk, k, v)
    sub = effective_chunk_size(call.options.get("sub_chunk", 8), chunk)
    chunk = math.ceil(chunk / sub) * sub
    if training:
        per_token = gla_op_train_flops(chunk, k, v, sub, math.ceil(seq_len / chunk))
    else:
        per_token = gla_op_flops(chunk, k, v, sub)
    return heads * padding_factor(seq_len, chunk) * per_token


def _delta_rule(call: OpCall, seq_len: int, training: bool) -> float:
    heads, k, v, chunk, padding = _heads(call, seq_len)
    if training:
        return heads * padding * delta_rule_op_train_flops(chunk, k, v, math.ceil(seq_len / chunk))
    return heads * padding * delta_rule_op_flops(chunk, k, v)


def _kda(call: OpCall, seq_len: int, training: bool) -> float:
    """A decay per key channel: at the chunk the op uses, a whole number of sub-chunks; per head, the delta rule's."""
    if call.args[3].dim() == 3:
        return _delta_rule(call, seq_len, training)
    heads, k, v, chunk, _ = _heads(call, seq_len)
    sub = effective_chunk_size(call.options.get("sub_chunk", 8), chunk)
    chunk = math.ceil(chunk / sub) * sub
    if training:
        per_token = kda_op_train_flops(chunk, k, v, sub, math.ceil(seq_len / chunk))
    else:
        per_token = kda_op_flops(chunk, k, v, sub)
    return heads * padding_factor(seq_len, chunk) * per_token


def _delta_product(call: OpCall, seq_len: int, training: bool) -> float:
    """The delta rule over n_h rows a token, in chunks of rows."""
    q, k, v = call.args[:3]
    heads, n_h = q.shape[2], k.shape[1] // q.shape[1]
    rows = seq_len * n_h
    chunk = effective_chunk_size(call.options.get("chunk_size", 64), rows)
    if training:
        per_token = delta_product_op_train_flops(chunk, k.shape[-1], v.shape[-1], n_h, math.ceil(rows / chunk))
    else:
        per_token = delta_product_op_flops(chunk, k.shape[-1], v.shape[-1], n_h)
    return heads * padding_factor(rows, chunk) * per_token


def _precond_delta_rule(call: OpCall, seq_len: int, training: bool) -> float:
    heads, k, v, chunk, padding = _heads(call, seq_len)
    if training:
        return heads * padding * precond_delta_rule_op_train_flops(chunk, k, v, math.ceil(seq_len / chunk))
    return heads * padding * precond_delta_rule_op_flops(chunk, k, v)


def _mlstm(call: OpCall, seq_len: int, training: bool) -> float:
    heads, k, v, chunk, padding = _heads(call, seq_len)
    return (3 if training else 1) * heads * padding * mlstm_op_flops(chunk, k, v)


def _mesa(call: OpCall, seq_len: int, training: bool) -> float:
    """At the call's CG steps; with cg_tol at `expected_cg_steps`, a plan's estimate (what a run spent is
    `_mesa_spent`). With 0 steps H_T is still carried: one product, no backward (no loss reads it)."""
    heads, k, v, chunk, padding = _heads(call, seq_len)
    steps = expected_cg_steps(call.options.get("cg_steps", 30), call.options.get("cg_tol"))
    per_head = padding * (mesa_op_train_flops if training else mesa_op_flops)(chunk, k, v, steps)
    if steps == 0:
        per_head += 2 * k * k
    return heads * per_head


def _mesa_spent(call: OpCall, info: dict, seq_len: int, training: bool) -> float:
    """The call as it ran: with cg_tol, the CG steps the telemetry says the code ran (`iterations_run`, forward and,
    training, adjoint: lm.ops.mesa counts a loop as running until its last token has converged) instead of the
    planned ones. A fixed-step call is the analytic count, with no read of the telemetry (no device sync)."""
    steps, tol = call.options.get("cg_steps", 30), call.options.get("cg_tol")
    at_steps = dataclasses.replace(call, options={**call.options, "cg_tol": None})
    counted = _mesa(at_steps, seq_len, training)
    ran = info.get("iterations_run")
    if steps == 0 or tol is None or ran is None:
        return counted
    extra = float(ran) - steps
    if training:
        extra += float(info.get("adjoint_iterations_run", steps)) - steps
    heads, k, _, chunk, padding = _heads(call, seq_len)
    return counted + extra * heads * padding * mesa_cg_step_flops(chunk, k)


def _mesa_note(call: OpCall) -> str | None:
    steps, tol = call.options.get("cg_steps", 30), call.options.get("cg_tol")
    if tol is None or steps == 0:
        return None
    return (f"mesa with cg_tol {tol:g} is planned at {expected_cg_steps(steps, tol)} expected CG steps of at most "
            f"{steps} (a residual falling {PLANNED_CG_RATE:g}x a step); its runs log the steps they ran (train/flops)")


def _mesa_workspace(call: OpCall) -> float:
    """The CG solve's buffers, float32 whatever the precision: per token and head the chunked keys (K), the decay
    weights of its chunk (C), its share of the chunk's entering key state (K^2 / C), and about ten K-vectors of CG and
    its matrix-vector products (x, r, p, A p, b, the Jacobi diagonal and their temporaries)."""
    q, chunk = call.args[0], call.options.get("chunk_size", 64)
    heads, k = q.shape[2], q.shape[-1]
    return 4 * heads * (2 * chunk + k * k / chunk + 10 * k)


@dataclasses.dataclass(frozen=True)
class OpCost:
    """An op's count for a call: `flops(call, seq_len, training)` per token, all heads, as planned; `spent(call,
    info, seq_len, training)` as the call ran, from its telemetry `info` (None: as planned); `note(call)`, what a
    plan's count assumes (None: nothing); `workspace(call)`, bytes per token of working memory beyond what autograd
    saves."""

    flops: Callable[[OpCall, int, bool], float]
    spent: Callable[[OpCall, dict, int, bool], float] | None = None
    note: Callable[[OpCall], str | None] = lambda call: None
    workspace: Callable[[OpCall], float] = lambda call: 0.0


COSTS: dict[str, OpCost] = {
    "linear_attention": OpCost(_linear_attention),
    "delta_rule": OpCost(_delta_rule),
    "diagonal_scan": OpCost(lambda call, seq_len, training: diagonal_scan_op_flops()),
    "mlstm": OpCost(_mlstm),
    "mesa": OpCost(_mesa, _mesa_spent, _mesa_note, _mesa_workspace),
    "kda": OpCost(_kda),
    "delta_product": OpCost(_delta_product),
    "precond_delta_rule": OpCost(_precond_delta_rule),
}

"""Transfer maps: how the state a piece of a sequence ends with depends on the state it starts from.

Every op's state is an affine function of its initial state: final = map(initial) + final_from_zero (mLSTM's up to
its stabiliser, below). So the pieces of a sequence split over ranks (context parallelism,
lm/mixers/context_parallel.py) can each run from the zero state at once, exchange (map, final_from_zero), and compose
what each piece really starts from, without waiting for the piece before. A reset inside a piece clears the state,
so its map is zero there.

    linear_attention, diagonal_scan, mesa   the map is the product of the piece's decays: its log, summed over the
                                            piece (`piece_log_decay`: [B, H], [B, H, K] per key or [B, D]), -inf
                                            in a row with a reset; `carry_decayed` applies it (Mesa: G and H alike)
    delta_rule, kda, delta_product          the product of the steps' transitions (alpha_t (I - beta_t k_t k_t^T);
                                            KDA's (I - k_t (b_t * k_t)^T) Diag(alpha_t); DeltaProduct's per row), a
                                            K x K matrix per head, read off the op itself (`delta_rule_transfer`,
                                            lm.ops.kda, lm.ops.delta_product)
    precond_delta_rule                      S's map as the delta rule's, which depends on the preconditioner's
                                            state A entering the piece: A (a decayed sum) is composed first
                                            (`Transfer.first`), then each piece's S map from its true entering A
    mlstm                                   C and n decay by the product of forget gates as above; the stabiliser m
                                            is a max-plus recurrence, exact with (sum of log f, the largest write's
                                            log-weight at the end) (`mlstm_transfer`, `carry_mlstm`)

`carry_*(initial, transfer, final_from_zero)` is the state at the piece's end from `initial` (None: zero), the map
exactly as the sequential op applies it, so that composing the pieces equals one call to float rounding (the tests
check each op in float64 against the op run whole, resets on and inside piece boundaries included).

`TRANSFERS` finds both by the op's name (lm.ops.call): `piece_transfer(call, reset)` is what the context-parallel
exchange (lm.mixers.context_parallel) and the memory plan (lm.accounting.memory) run for a mixer's `OpCall`.
"""

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lm.ops.call import OpCall
from lm.ops.delta_product import carry_delta_product, delta_product_transfer
from lm.ops.delta_rule import delta_rule
from lm.ops.kda import carry_kda, kda_transfer
from lm.ops.precond_delta_rule import carry_precond, carry_precond_a, precond_a_transfer, precond_transfer


def piece_log_decay(log_decay: torch.Tensor, reset: torch.Tensor | None) -> torch.Tensor:
    """log of the product of the piece's decays: log_decay [B, T, *] summed over T, -inf in rows with a reset
    (the state entering the piece is cleared there and reaches nothing after it)."""
    total = log_decay.sum(1)
    if reset is None:
        return total
    cleared = reset.any(1).view(-1, *[1] * (total.dim() - 1))
    return total.masked_fill(cleared, -math.inf)


def carry_decayed(initial, log_transfer: torch.Tensor, final_from_zero):
    """final_from_zero + exp(log_transfer) * initial, for a state tensor or a tuple of them (Mesa's G and H); the
    per-row map [B, *] broadcasts over the state's trailing dims."""
    if initial is None:
        return final_from_zero
    if isinstance(final_from_zero, tuple):
        return tuple(carry_decayed(s, log_transfer, f) for s, f in zip(initial, final_from_zero))
    decay = log_transfer.exp().to(final_from_zero.dtype)
    decay = decay.reshape(*decay.shape, *[1] * (final_from_zero.dim() - decay.dim()))
    return final_from_zero + decay * initial


def delta_rule_transfer(q, k, v, beta, log_alpha, scale, *, reset=None, chunk_size=64, backend="auto"):
    """(final state from zero [B, H, K, V], map [B, H, K, K]) of a delta-rule piece, in one call of the op: the
    state's columns evolve independently, so K more value columns that start as the identity and receive v = 0 end
    as the product of the steps' transitions, and the first V as the final state from zero."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    eye = torch.eye(K, dtype=torch.float64 if v.dtype == torch.float64 else torch.float32, device=v.device)
    initial = torch.cat([eye.new_zeros(B, H, K, V), eye.expand(B, H, K, K)], dim=-1)
    wide_v = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    _, final = delta_rule(q, k, wide_v, beta, log_alpha, scale, initial_state=initial, reset=reset,
                          chunk_size=chunk_size, backend=backend)
    return final[..., :V], final[..., V:]


def carry_delta_rule(initial, transfer: torch.Tensor, final_from_zero: torch.Tensor):
    """final_from_zero + transfer @ initial per head."""
    if initial is None:
        return final_from_zero
    return final_from_zero + transfer @ initial.to(transfer.dtype)


def mlstm_transfer(i_pre: torch.Tensor, f_pre: torch.Tensor, reset: torch.Tensor | None, final_from_zero):
    """(sum of log f over the piece [B, H], the stabiliser's floor [B, H]) of an mLSTM piece whose final state from
    the zero state is final_from_zero = (C~0, n~0, m0).

    The stabiliser is a max-plus recurrence, m_t = max(log f_t + m_{t-1}, i_pre_t), so the piece ends with
    m = max(F + m_in, W) for the m_in it starts from, F the sum of log f and W = max_s (i_pre_s + sum_{u>s} log f_u)
    the largest write's log-weight at the end. In a row with a reset the piece ends as it does from zero whatever it
    starts from: F = -inf and W = m0 there. Both are detached, as every stabiliser of lm.ops.mlstm is."""
    log_f = F.logsigmoid(f_pre.to(final_from_zero[2].dtype))
    with torch.no_grad():
        after = log_f.flip(1).cumsum(1).flip(1) - log_f  # sum_{u>s} log f_u: [B, T, H]
        floor = (i_pre.to(log_f.dtype) + after).amax(1)
    total = piece_log_decay(log_f, reset)
    if reset is not None:
        floor = torch.where(reset.any(1)[:, None], final_from_zero[2], floor)
    return total, floor


def carry_mlstm(initial, transfer, final_from_zero):
    """The stabilised (C~, n~, m) at the piece's end from initial = (C~_in, n~_in, m_in): the represented
    C = exp(F) C_in + C_0 (and n alike), stabilised by m = max(F + m_in, W) as the op's own recurrence would be."""
    if initial is None:
        return final_from_zero
    total, floor = transfer
    C_in, n_in, m_in = initial
    C_0, n_0, m_0 = final_from_zero
    m = torch.maximum(total + m_in, floor).detach()
    keep, write = (total + m_in - m).exp(), (m_0 - m).exp()
    C = keep[..., None, None] * C_in + write[..., None, None] * C_0
    return C, keep[..., None] * n_in + write[..., None] * n_0, m


@dataclasses.dataclass(frozen=True)
class Transfer:
    """An op's transfer map: `map(call, reset)` -> (the final state from zero, the map), and its composition
    `carry(initial, map, final_from_zero)`. `first`: a part of the state that evolves alone and on which the rest's
    map depends (the preconditioner's A of precond_delta_rule); the pieces exchange and compose it first, and `map`
    then takes the piece's entering value of it as a third argument."""

    map: Callable[..., tuple]
    carry: Callable
    first: "Transfer | None" = None


def decayed(decay: int, **zero_state_options) -> Callable:
    """The map of an op whose state decays by the product of its `decay`-th input (a log-decay [B, T, ...]): the
    call run from zero (with `zero_state_options`, which need not give the same outputs, only the same state), and
    that product."""

    def map_of(call: OpCall, reset: torch.Tensor | None) -> tuple:
        _, final = call.forms.chunkwise(*call.args, reset=reset, **{**call.options, **zero_state_options})[:2]
        return final, piece_log_decay(call.args[decay], reset)

    return map_of


def _delta_rule_map(call: OpCall, reset: torch.Tensor | None) -> tuple:
    return delta_rule_transfer(*call.args, reset=reset, **call.options)


def _kda_map(call: OpCall, reset: torch.Tensor | None) -> tuple:
    return kda_transfer(*call.args, reset=reset, **call.options)


def _delta_product_map(call: OpCall, reset: torch.Tensor | None) -> tuple:
    return delta_product_transfer(*call.args, reset=reset, **call.options)


def _precond_a_map(call: OpCall, reset: torch.Tensor | None) -> tuple:
    _, k, _, _, _, beta_a, log_alpha_a, *_ = call.args
    return precond_a_transfer(k, beta_a, log_alpha_a, reset=reset)


def _precond_map(call: OpCall, reset: torch.Tensor | None, entering_a) -> tuple:
    return precond_transfer(*call.args, initial_A=entering_a, reset=reset, **call.options)


def _mlstm_map(call: OpCall, reset: torch.Tensor | None) -> tuple:
    _, final = call.forms.chunkwise(*call.args, reset=reset, **call.options)
    _, _, _, i_pre, f_pre = call.args
    return final, mlstm_transfer(i_pre, f_pre, reset, final)


TRANSFERS: dict[str, Transfer] = {
    "linear_attention": Transfer(decayed(3), carry_decayed),  # (q, k, v, log_gamma, ...)
    "diagonal_scan": Transfer(decayed(1), carry_decayed),  # (x, log_a)
    # G and H from zero need no solve: with 0 CG steps (gated linear attention) the op ends with them.
    "mesa": Transfer(decayed(3, cg_steps=0, cg_tol=None, return_info=False, backend="auto"), carry_decayed),
    "delta_rule": Transfer(_delta_rule_map, carry_delta_rule),
    "mlstm": Transfer(_mlstm_map, carry_mlstm),
    "kda": Transfer(_kda_map, carry_kda),
    "delta_product": Transfer(_delta_product_map, carry_delta_product),
    "precond_delta_rule": Transfer(_precond_map, carry_precond, first=Transfer(_precond_a_map, carry_precond_a)),
}


def piece_transfer(call: OpCall, reset: torch.Tensor | None, entering_first=None) -> tuple:
    """(the state a piece ends with from zero, its transfer map) for the op call of the piece; for an op with a
    `first` part, given that part's state entering the piece."""
    transfer = TRANSFERS[call.op]
    if transfer.first is not None:
        return transfer.map(call, reset, entering_first)
    return transfer.map(call, reset)


def first_transfer(call: OpCall, reset: torch.Tensor | None) -> tuple | None:
    """The piece's (final state from zero, map) of the op's `first` part, or None for an op without one."""
    first = TRANSFERS[call.op].first
    return None if first is None else first.map(call, reset)


def carry_first(op: str, initial, transfer, final_from_zero):
    """The op's `first` part at a piece's end from `initial` (None: zero)."""
    return TRANSFERS[op].first.carry(initial, transfer, final_from_zero)


def carry(op: str, initial, transfer, final_from_zero):
    """The state at a piece's end when it starts from `initial` (None: zero), by op `op`'s composition."""
    return TRANSFERS[op].carry(initial, transfer, final_from_zero)

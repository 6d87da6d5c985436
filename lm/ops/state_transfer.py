"""Transfer maps: how the state a piece of a sequence ends with depends on the state it starts from.

Every op's state is an affine function of its initial state: final = map(initial) + final_from_zero (mLSTM's up to
its stabiliser, below). So the pieces of a sequence split over ranks (context parallelism, lm/mixers/context.py)
can each run from the zero state at once, exchange (map, final_from_zero), and compose what each piece really starts
from, without waiting for the piece before. A reset inside a piece clears the state, so its map is zero there.

    linear_attention, diagonal_scan, mesa   the map is the product of the piece's decays: its log, summed over the
                                            piece (`piece_log_decay`: [B, H], [B, H, K] per key or [B, D]), -inf
                                            in a row with a reset; `carry_decayed` applies it (Mesa: G and H alike)
    delta_rule                              the product of the steps' alpha_t (I - beta_t k_t k_t^T), a K x K
                                            matrix per head, read off the op itself (`delta_rule_transfer`)
    mlstm                                   C and n decay by the product of forget gates as above; the stabiliser m
                                            is a max-plus recurrence, exact with (sum of log f, the largest write's
                                            log-weight at the end) (`mlstm_transfer`, `carry_mlstm`)

`carry_*(initial, transfer, final_from_zero)` is the state at the piece's end from `initial` (None: zero), the map
exactly as the sequential op applies it, so that composing the pieces equals one call to float rounding (the tests
check each op in float64 against the op run whole, resets on and inside piece boundaries included).
"""

import math

import torch
import torch.nn.functional as F

from lm.ops.delta_rule import delta_rule


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

"""lm.ops.diagonal_scan: chunkwise and recurrent forms against a per-token reference of the recurrence
h_t = exp(log_a_t) h_{t-1} + x_t."""

import pytest
import torch
from op_checks import (
    Op,
    assert_close,
    check_backends,
    check_bfloat16,
    check_reference,
    check_split,
    check_zero_state_is_default,
    fake_module,
)
from torch.utils.flop_counter import FlopCounterMode

from lm.ops import diagonal_scan, diagonal_scan_recurrent
from lm.ops import flops as op_flops

B, D = 2, 6


def reference(x, log_a, initial_state):
    """The recurrence written out token by token."""
    h, outs = initial_state, []
    for t in range(x.shape[1]):
        h = torch.exp(log_a[:, t]) * h + x[:, t]
        outs.append(h)
    return torch.stack(outs, dim=1), h


def make_inputs(T, dtype=torch.float64, seed=0, requires_grad=False, strongest=-3.0):
    """x, log-decays uniform in [strongest, 0], a random initial state."""
    g = torch.Generator().manual_seed(seed)
    x = dict(
        x=torch.randn(B, T, D, generator=g, dtype=dtype),
        log_a=strongest * torch.rand(B, T, D, generator=g, dtype=dtype),
        initial_state=torch.randn(B, D, generator=g, dtype=dtype),
    )
    return {n: t.requires_grad_(requires_grad) for n, t in x.items()}


def chunkwise(x, chunk_size=16):
    return diagonal_scan(x["x"], x["log_a"], initial_state=x["initial_state"], chunk_size=chunk_size, backend="torch")


def recurrent(x):
    return diagonal_scan_recurrent(x["x"], x["log_a"], initial_state=x["initial_state"])


def ref(x):
    return reference(x["x"], x["log_a"], x["initial_state"])


OP = Op(chunkwise, recurrent, ref)


def check_against_reference(fn, x):
    check_reference(OP, fn, x, 1e-10, shapes=(tuple(x["x"].shape), [(B, D)]), grad_tol=1e-10)


# chunk 4 on T = 200 takes three levels of chunks (200 -> 50 -> 13 -> 4)
@pytest.mark.parametrize(
    "T,chunk_size", [(1, 16), (17, 16), (64, 16), (65, 16), (200, 16), (200, 64), (200, 4), (20, 1)]
)
def test_chunkwise_matches_reference_float64(T, chunk_size):
    check_against_reference(lambda x: chunkwise(x, chunk_size), make_inputs(T, requires_grad=True))


@pytest.mark.parametrize("T", [1, 17, 65])
def test_recurrent_matches_reference_float64(T):
    check_against_reference(recurrent, make_inputs(T, requires_grad=True))


def test_split_sequence_with_carried_state_equals_one_call():
    # and decoding: one step with the recurrent form from the chunkwise state
    check_split(OP, make_inputs(100), [37], 1e-10, decode=(37, 38, 1))


def test_zero_initial_state_is_default():
    check_zero_state_is_default(OP, make_inputs(30), lambda x: diagonal_scan(x["x"], x["log_a"], chunk_size=8),
                                recurrent_tol=1e-12, chunk_size=8)


def test_float32_strong_decay_stays_finite_and_accurate():
    """log_a down to -20 per step: over a chunk of 64 the cumulative log-decay reaches -1280, far outside float32's
    range if it were ever exponentiated with the wrong sign."""
    x = make_inputs(300, strongest=-20.0)
    out_ref, state_ref = ref(x)
    x32 = {n: t.float().requires_grad_() for n, t in x.items()}
    out, state = chunkwise(x32, 64)
    assert out.dtype == state.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    assert_close(out.double(), out_ref, 1e-5)
    assert_close(state.double(), state_ref, 1e-5)
    (out.sum() + state.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in x32.values())
    assert_close(recurrent(x32)[0], out, 1e-5)


def test_bfloat16_inputs():
    check_bfloat16(OP, make_inputs(70, torch.float32))


def test_checks():
    x = make_inputs(5, torch.float32)
    with pytest.raises(ValueError, match="log_a"):
        diagonal_scan(x["x"], x["log_a"][:, :4])
    with pytest.raises(ValueError, match="initial_state"):
        diagonal_scan_recurrent(x["x"], x["log_a"], initial_state=x["initial_state"][:, :2])
    check_backends(lambda **kw: diagonal_scan(x["x"], x["log_a"], **kw))


def test_flops_are_zero_for_the_counter():
    """No matrix products: FlopCounterMode counts nothing, forward or backward, as diagonal_scan_op_flops says."""
    x = make_inputs(100, torch.float32, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        out, state = chunkwise(x)
        (out.square().mean() + state.sum()).backward()
    assert counter.get_total_flops() == op_flops.diagonal_scan_op_flops() == 0


def test_fla_glue_with_a_fake_fla(monkeypatch):
    """The fla adapter (g = log_a, initial/final state) against a stand-in for fla.ops.hgrn.fused_recurrent_hgrn
    following fla's naive_recurrent_hgrn, since fla needs a GPU."""
    from lm.ops.fla import fla_diagonal_scan

    def fused_recurrent_hgrn(x, g, initial_state=None, output_final_state=False, cu_seqlens=None):
        h = torch.zeros_like(x[:, 0]) if initial_state is None else initial_state
        outs = []
        for i in range(x.shape[1]):
            h = g[:, i].exp() * h + x[:, i]
            outs.append(h)
        return torch.stack(outs, 1), h if output_final_state else None

    fake_module(monkeypatch, "fla.ops.hgrn", fused_recurrent_hgrn=fused_recurrent_hgrn)
    x = make_inputs(20, torch.float32)
    out, state = fla_diagonal_scan(x["x"], x["log_a"], x["initial_state"])
    out_ref, state_ref = chunkwise(x)
    assert_close(out, out_ref, 1e-5)
    assert_close(state, state_ref, 1e-5)

"""lm.ops.diagonal_scan: chunkwise and recurrent forms against a per-token reference of the recurrence
h_t = exp(log_a_t) h_{t-1} + x_t."""

import pytest
import torch
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


def gradients(fn, x, seed=1):
    """Gradients w.r.t. every input of a random projection of fn's output and final state."""
    out, state = fn(x)
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    loss = loss + (state * torch.randn(state.shape, generator=g, dtype=state.dtype)).sum()
    return dict(zip(x, torch.autograd.grad(loss, list(x.values()))))


def assert_close(a, b, tol, msg=None):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=msg)


def check_against_reference(fn, x):
    out, state = fn(x)
    out_ref, state_ref = ref(x)
    assert out.shape == out_ref.shape and state.shape == (B, D) and out.dtype == state.dtype == torch.float64
    assert_close(out, out_ref, 1e-10)
    assert_close(state, state_ref, 1e-10)
    grads = gradients(fn, x)
    for name, grad in gradients(ref, x).items():
        assert_close(grads[name], grad, 1e-10, msg=f"gradient w.r.t. {name}")


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
    x = make_inputs(100)
    out, state = chunkwise(x)
    out1, state1 = chunkwise(dict(x=x["x"][:, :37], log_a=x["log_a"][:, :37], initial_state=x["initial_state"]))
    out2, state2 = chunkwise(dict(x=x["x"][:, 37:], log_a=x["log_a"][:, 37:], initial_state=state1))
    assert_close(torch.cat([out1, out2], dim=1), out, 1e-10)
    assert_close(state2, state, 1e-10)
    # decoding: one step with the recurrent form from the chunkwise state
    out_step, _ = diagonal_scan_recurrent(x["x"][:, 37:38], x["log_a"][:, 37:38], initial_state=state1)
    assert_close(out_step, out[:, 37:38], 1e-10)


def test_zero_initial_state_is_default():
    x = make_inputs(30)
    out, state = diagonal_scan(x["x"], x["log_a"], chunk_size=8)
    zero = dict(x, initial_state=torch.zeros(B, D, dtype=torch.float64))
    assert_close(out, chunkwise(zero, 8)[0], 1e-12)
    assert_close(state, recurrent(zero)[1], 1e-12)


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
    x = make_inputs(70, torch.float32)
    out32, state32 = chunkwise(x)
    x16 = dict(x, x=x["x"].bfloat16(), log_a=x["log_a"].bfloat16())
    for out, state in (chunkwise(x16), recurrent(x16)):
        assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
        assert (out.float() - out32).norm() / out32.norm() < 2e-2
        assert (state - state32).norm() / state32.norm() < 2e-2


def test_checks():
    x = make_inputs(5, torch.float32)
    with pytest.raises(ValueError, match="log_a"):
        diagonal_scan(x["x"], x["log_a"][:, :4])
    with pytest.raises(ValueError, match="initial_state"):
        diagonal_scan_recurrent(x["x"], x["log_a"], initial_state=x["initial_state"][:, :2])
    with pytest.raises(ValueError, match="backend"):
        diagonal_scan(x["x"], x["log_a"], backend="cuda")
    with pytest.raises(RuntimeError, match="CUDA"):
        diagonal_scan(x["x"], x["log_a"], backend="fla")


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
    import sys
    import types

    from lm.ops.fla import fla_diagonal_scan

    def fused_recurrent_hgrn(x, g, initial_state=None, output_final_state=False, cu_seqlens=None):
        h = torch.zeros_like(x[:, 0]) if initial_state is None else initial_state
        outs = []
        for i in range(x.shape[1]):
            h = g[:, i].exp() * h + x[:, i]
            outs.append(h)
        return torch.stack(outs, 1), h if output_final_state else None

    fake = types.ModuleType("fla.ops.hgrn")
    fake.fused_recurrent_hgrn = fused_recurrent_hgrn
    monkeypatch.setitem(sys.modules, "fla.ops.hgrn", fake)
    x = make_inputs(20, torch.float32)
    out, state = fla_diagonal_scan(x["x"], x["log_a"], x["initial_state"])
    out_ref, state_ref = chunkwise(x)
    assert_close(out, out_ref, 1e-5)
    assert_close(state, state_ref, 1e-5)

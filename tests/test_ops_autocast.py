"""Under autocast (Lightning's bf16-mixed) every op keeps its state and decay arithmetic in float32: called with
float32 inputs inside `torch.autocast`, it returns what it returns outside, and its gradients are those of the plain
call. (Mesa on ill-conditioned inputs, and a model under autocast: tests/test_op_mesa.py.)"""

import pytest
import torch

from lm.bench.mixer_speed import bench_mixer_names, op_inputs
from lm.ops.call import FORMS


def flat(result):
    """The tensors of an op's (out, state) result, state tuples flattened."""
    out, state = result
    return [out, *(state if isinstance(state, tuple) else (state,))]


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
@pytest.mark.parametrize("mixer", bench_mixer_names())
def test_op_ignores_autocast(mixer, form):
    op, args, _ = op_inputs(mixer, 70, 64, 2, 16, 1)
    fn = getattr(FORMS[op], form)
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    plain = flat(fn(*args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = flat(fn(*args))
    for a, p in zip(autocast, plain):
        assert a.dtype == p.dtype == torch.float32
        torch.testing.assert_close(a, p, rtol=1e-6, atol=1e-6)


def grads(fn, args, forward_autocast: bool, backward_autocast: bool):
    """The gradients w.r.t. every tensor input of a fixed random projection of the output and of the final state,
    with the forward and the backward each run under bf16 autocast or not."""
    args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=forward_autocast):
        results = flat(fn(*args))
        g = torch.Generator().manual_seed(1)
        loss = sum((r.float() * torch.randn(r.shape, generator=g)).sum() for r in results)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=backward_autocast):
        return torch.autograd.grad(loss, [a for a in args if isinstance(a, torch.Tensor)], allow_unused=True)


def assert_same_grads(autocast, plain):
    assert any(p is not None for p in plain)
    for i, (a, p) in enumerate(zip(autocast, plain)):
        assert (a is None) == (p is None), i
        if p is not None:
            assert a.dtype == p.dtype == torch.float32, i
            torch.testing.assert_close(a, p, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"input {i}: {m}")


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
@pytest.mark.parametrize("mixer", bench_mixer_names())
def test_op_gradients_ignore_autocast(mixer, form):
    """The gradients as Lightning's bf16-mixed takes them (forward under autocast, backward after it) are those of the
    plain float32 call: no part of the graph autograd records for the backward is a bf16 op."""
    op, args, _ = op_inputs(mixer, 70, 64, 2, 16, 1)
    fn = getattr(FORMS[op], form)
    plain = grads(fn, args, forward_autocast=False, backward_autocast=False)
    assert all(torch.isfinite(p).all() for p in plain if p is not None)
    assert_same_grads(grads(fn, args, forward_autocast=True, backward_autocast=False), plain)


def test_custom_backward_ignores_autocast():
    """A backward called inside autocast runs under it (the autograd engine carries the caller's autocast state into
    the backward), and plain autograd's backward formulas then follow it, as PyTorch documents. An op's own backward
    must not: Mesa's chunkwise backward (its adjoint CG solve and surrogate) turns autocast off, so its gradients under
    autocast, forward and backward, are the plain ones. (On ill-conditioned inputs, against float64:
    tests/test_op_mesa.py.)"""
    _, args, _ = op_inputs("mesa", 70, 64, 2, 16, 1)
    plain = grads(FORMS["mesa"].chunkwise, args, forward_autocast=False, backward_autocast=False)
    assert_same_grads(grads(FORMS["mesa"].chunkwise, args, forward_autocast=True, backward_autocast=True), plain)

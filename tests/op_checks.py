"""The checks every op of lm.ops shares (docs/design.md, "Op contract"): the chunkwise and recurrent forms against a
float64 token-by-token reference at lengths that are not multiples of the chunk, against each other in float32, with
gradients; a sequence split anywhere with the state carried (and decoding continuing from it); the zero state as the
default; long sequences of strong decays; bf16 inputs; the backend argument. Each tests/test_op_*.py describes its op
as an `Op` and calls these with the cases and tolerances that fit it; what is particular to an op stays in its file.
(Resets, the same for every op but the mLSTM, are in tests/test_op_resets.py.)"""

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True)
class Op:
    """An op as its checks see it. Inputs are a dict of named tensors: those with a time axis ([B, T, ...]), the
    initial state (`state`, in the order of the op's returned state) and any without a time axis (`static`)."""

    chunkwise: Callable[..., tuple]  # (inputs, chunk_size=..., **options) -> (out, state)
    recurrent: Callable[..., tuple]  # (inputs, **options) -> (out, state)
    reference: Callable[[dict], tuple]  # inputs -> (out, state as the reference holds it), token by token
    state: tuple[str, ...] = ("initial_state",)
    static: tuple[str, ...] = ()
    exact: Callable | None = None  # the op's state -> the reference's (the mLSTM: its unstabilised form)

    def parts(self, state) -> tuple:
        """The state as a tuple of tensors, as the reference holds it."""
        return as_tuple(self.exact(state) if self.exact else state)

    def with_state(self, x: dict, state) -> dict:
        return dict(x, **dict(zip(self.state, as_tuple(state))))

    def steps(self, x: dict, lo: int, hi: int, state=None) -> dict:
        """Steps [lo, hi) of the inputs, from `state` (default: x's initial state)."""
        piece = {n: t if n in self.state or n in self.static else t[:, lo:hi] for n, t in x.items()}
        return piece if state is None else self.with_state(piece, state)


def as_tuple(state) -> tuple:
    return state if isinstance(state, tuple) else (state,)


def assert_close(a, b, tol, msg=None):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=msg)


def assert_results_close(got, want, tol, state_tol=None, op: Op | None = None):
    """(out, state) against (out, state); the state as the reference holds it when `op` is given."""
    assert_close(got[0], want[0], tol)
    parts = op.parts if op else as_tuple
    for a, b in zip(parts(got[1]), as_tuple(want[1]), strict=True):
        assert_close(a, b, tol if state_tol is None else state_tol)


def gradients(fn, x: dict, seed: int = 1, view=as_tuple) -> dict:
    """Gradients w.r.t. every input of a random projection of fn's output and final state (each of its tensors as
    `view` gives them), the projections drawn in that order from `seed`."""
    out, state = fn(x)
    g = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in (out, *view(state)))
    return dict(zip(x, torch.autograd.grad(loss, list(x.values()))))


def check_gradients(op: Op, fn, x: dict, tol: float, seed: int = 1) -> None:
    """fn's gradients (fn: a form of the op) against the reference's, w.r.t. every input and the initial state."""
    want = gradients(op.reference, x, seed)
    for name, grad in gradients(fn, x, seed, view=op.parts).items():
        torch.testing.assert_close(grad, want[name], rtol=tol, atol=tol, msg=lambda m, n=name: f"d/d{n}: {m}")


def check_reference(op: Op, fn, x: dict, tol: float, state_tol: float | None = None, shapes=None,
                    grad_tol: float | None = None) -> None:
    """fn(x) (a form of the op) against the reference: the output and every state tensor within `tol` (the states
    within `state_tol` if given), float64 in and out; with `shapes` ((out shape, [state shapes])) those too, and with
    `grad_tol` the gradients as well."""
    got = fn(x)
    if shapes is not None:
        out_shape, state_shapes = shapes
        assert tuple(got[0].shape) == out_shape and [tuple(s.shape) for s in as_tuple(got[1])] == state_shapes
        assert got[0].dtype == torch.float64 and all(s.dtype == torch.float64 for s in as_tuple(got[1]))
    assert_results_close(got, op.reference(x), tol, state_tol, op)
    if grad_tol is not None:
        check_gradients(op, fn, x, grad_tol)


def check_forms_agree(op: Op, x: dict, chunk_size: int, tol: float, state_tol: float | None = None,
                      **options) -> None:
    """Chunkwise (with `options`) and recurrent agree (typically in float32: the dtype of x's inputs is kept, the
    state's too)."""
    out, state = op.chunkwise(x, chunk_size, **options)
    dtype = x[next(n for n in x if n not in op.state)].dtype
    assert out.dtype == dtype and all(s.dtype == dtype for s in as_tuple(state))
    assert_results_close((out, state), op.recurrent(x), tol, state_tol)


def check_split(op: Op, x: dict, cuts: list[int], tol: float, state_tol: float | None = None,
                decode: tuple[int, int, int] | None = None, **options) -> None:
    """The chunkwise form (with `options`) over the pieces [0, cuts..., T), each from the state the one before left,
    equals one call; with `decode` = (start, stop, step) (start one of the cuts), the recurrent form continues from
    the state at start, `step` tokens a call, and gives the one call's outputs up to stop (and its final state if stop
    is T)."""
    T = next(t for n, t in x.items() if n not in op.state and n not in op.static).shape[1]
    whole = op.chunkwise(x, **options)
    outs, state, at = [], None, {}
    for lo, hi in zip([0, *cuts], [*cuts, T]):
        out, state = op.chunkwise(op.steps(x, lo, hi, state), **options)
        outs.append(out)
        at[hi] = state
    assert_results_close((torch.cat(outs, dim=1), state), whole, tol, state_tol)
    if decode is None:
        return
    start, stop, step = decode
    outs, state = [], at[start]
    for lo in range(start, stop, step):
        out, state = op.recurrent(op.steps(x, lo, min(lo + step, stop), state))
        outs.append(out)
    assert_close(torch.cat(outs, dim=1), whole[0][:, start:stop], tol)
    if stop == T:
        for a, b in zip(as_tuple(state), as_tuple(whole[1]), strict=True):
            assert_close(a, b, tol if state_tol is None else state_tol)


def check_zero_state_is_default(op: Op, x: dict, default, tol: float = 1e-12, recurrent_tol: float | None = None,
                                **options) -> None:
    """default(x), the op called without an initial state, equals the chunkwise form (with `options`) from a zero
    state (and, with `recurrent_tol`, the recurrent one)."""
    zero = dict(x, **{n: torch.zeros_like(x[n]) for n in op.state})
    got = default(x)
    assert_results_close(got, op.chunkwise(zero, **options), tol)
    if recurrent_tol is not None:
        assert_results_close(got, op.recurrent(zero), recurrent_tol)


def check_strong_decay(op: Op, x: dict, decay: str) -> None:
    """Per-step log-decays of -20 (cumulative sums far below float range) in patches of a 300-step sequence: finite
    and exact in float64, and in float32 close with finite gradients (an inf above the diagonal would turn into NaN
    in the backward pass)."""
    log_decay = x[decay].clone()
    log_decay[:, 10:200:7] = -20.0
    log_decay[:, 250:] = -20.0
    x = dict(x, **{decay: log_decay})
    out, state = op.chunkwise(x, chunk_size=64)
    assert torch.isfinite(out).all() and all(torch.isfinite(s).all() for s in as_tuple(state))
    want = op.reference(x)
    assert_results_close((out, state), want, 1e-10)
    x32 = {n: t.float().requires_grad_() for n, t in x.items()}
    out32, state32 = op.chunkwise(x32, chunk_size=64)
    assert_close(out32.double(), want[0], 1e-4)
    (out32.sum() + sum(s.sum() for s in as_tuple(state32))).backward()
    assert all(torch.isfinite(t.grad).all() for t in x32.values())


def check_bfloat16(op: Op, x: dict, tol: float = 2e-2, **options) -> None:
    """bf16 inputs (float32 x, the state left in float32): both forms return bf16 outputs and a float32 state, within
    `tol` (relative) of the float32 chunkwise result."""
    out32, state32 = op.chunkwise(x, **options)
    x16 = {n: t if n in op.state else t.bfloat16() for n, t in x.items()}
    for out, state in (op.chunkwise(x16, **options), op.recurrent(x16)):
        assert out.dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in as_tuple(state))
        for a, b in ((out, out32), *zip(as_tuple(state), as_tuple(state32), strict=True)):
            err = (a.float() - b).norm() / b.norm()
            assert err < tol, err


def check_backends(call, kernel: str = "fla") -> None:
    """call(**kw) runs the op on CPU float32 inputs: an unknown backend is a ValueError, the kernel backend on CPU
    a RuntimeError naming CUDA, and "auto" (the default) is the torch code there."""
    with pytest.raises(ValueError, match="backend"):
        call(backend="cuda")
    with pytest.raises(RuntimeError, match="CUDA"):
        call(backend=kernel)
    torch.testing.assert_close(call()[0], call(backend="torch")[0])


def fake_module(monkeypatch, name: str, **attributes) -> None:
    """Install a stand-in for the module `name` (an fla kernel, which needs a GPU) for the test's duration."""
    module = types.ModuleType(name)
    for attribute, value in attributes.items():
        setattr(module, attribute, value)
    monkeypatch.setitem(sys.modules, name, module)

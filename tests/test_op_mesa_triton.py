"""mesa(..., backend="triton"): lm's Triton kernels (lm/ops/mesa_triton.py), run on the CPU by Triton's interpreter,
against the float64 exact solve (the layer written out token by token with torch.linalg.solve) and against the torch
code step for step. On a machine with CUDA the compiled kernels are tested by tests/test_ops_gpu_mesa.py instead."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it where there is no CUDA
    pytest.skip("CUDA is here: tests/test_ops_gpu_mesa.py tests the compiled kernels", allow_module_level=True)
pytest.importorskip("triton", reason="the dev extra installs Triton, whose interpreter runs these kernels")

from gpu_helpers import raw_kernels  # noqa: E402, F401 (the kernels unchecked here: an autouse fixture)
from test_op_mesa import realistic_inputs, reference, relative_error  # noqa: E402

from lm.mixers import Mesa  # noqa: E402
from lm.ops import mesa_triton  # noqa: E402
from lm.ops.common import warn_once  # noqa: E402
from lm.ops.mesa import _resolve_backend, mesa  # noqa: E402

NAMES = ("q", "k", "v", "log_gamma", "beta", "lam", "G0", "H0")


def make_inputs(T, K=16, V=16, b=2, h=2, seed=0, state=True, dtype=torch.float32):
    """The paper's setting (test_op_mesa.realistic_inputs) and a carried state (G_0 random, H_0 symmetric positive
    semi-definite, as a previous call leaves it) or zeros, drawn in float64 and cast."""
    x = realistic_inputs(T, K, torch.float64, seed, b, h, Vd=V)
    g = torch.Generator().manual_seed(seed + 1)
    M = torch.randn(b, h, K, 2 * K, generator=g, dtype=torch.float64)
    x["G0"] = 0.3 * torch.randn(b, h, V, K, generator=g, dtype=torch.float64) * state
    x["H0"] = M @ M.mT / K * state
    return {n: t.to(dtype) for n, t in x.items()}


def make_reset(T, where):
    reset = torch.zeros(2, T, dtype=torch.bool)
    for row, steps in enumerate(where):
        reset[row, list(steps)] = True
    return reset


def run(x, reset=None, backend="triton", chunk_size=16, with_grads=True, **kw):
    """Output, final states, the gradients of a fixed random projection of all three w.r.t. every input, and the
    info dict (its adjoint entries filled by the backward)."""
    x = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    out, (G, Hs), info = mesa(*(x[n] for n in NAMES[:6]), initial_state=(x["G0"], x["H0"]), reset=reset,
                              chunk_size=chunk_size, backend=backend, return_info=True, **kw)
    grads = None
    if with_grads:
        g = torch.Generator().manual_seed(1)
        weight = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)
        loss = (out * weight(out)).sum() + (G * weight(G)).sum() + (Hs * weight(Hs)).sum()
        grads = dict(zip(x, torch.autograd.grad(loss, list(x.values()), allow_unused=True)))
    return out, (G, Hs), grads, info


def exact(x, reset=None):
    """The float64 exact solve of the same inputs (as the kernels see them: bf16 inputs rounded first), and the
    gradients of the same loss as `run`'s, through torch.linalg.solve."""
    x = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    out, (G, Hs) = reference(*(x[n] for n in NAMES[:6]), (x["G0"], x["H0"]), reset)
    g = torch.Generator().manual_seed(1)
    weight = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64)
    loss = (out * weight(out)).sum() + (G * weight(G)).sum() + (Hs * weight(Hs)).sum()
    return out, (G, Hs), dict(zip(x, torch.autograd.grad(loss, list(x.values()))))


RESETS = [(0, 5, 16, 17), (9, 36)]  # a reset at step 0, a one-token document, resets on and after a chunk boundary
CASES = {
    "odd length": dict(T=37),
    "one token": dict(T=1, state=True),
    "carried state": dict(T=21, state=True),
    "resets": dict(T=37, state=True, reset=RESETS),
    "cg_tol": dict(T=37, state=True, reset=RESETS, cg_tol=1e-6),
    "K and V not powers of two, one short chunk": dict(T=23, K=12, V=10, state=True, chunk_size=64),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_the_exact_solve(case):
    """Float32 inputs: the output within 1e-4 (relative) of the float64 exact solve, the final states too, and the
    gradient of every input within 1e-3."""
    spec = dict(CASES[case])
    T, reset = spec.pop("T"), spec.pop("reset", None)
    reset = None if reset is None else make_reset(T, reset)
    run_kw = {key: spec.pop(key) for key in ("cg_tol", "chunk_size") if key in spec}
    x = make_inputs(T, state=spec.pop("state", False), **spec)
    out, (G, Hs), grads, info = run(x, reset, **run_kw)
    out_ref, (G_ref, H_ref), grads_ref = exact(x, reset)
    assert out.dtype == torch.float32 and G.dtype == Hs.dtype == torch.float32
    assert relative_error(out, out_ref) < 1e-4
    assert relative_error(G, G_ref) < 1e-5 and relative_error(Hs, H_ref) < 1e-5
    for name in NAMES:
        assert relative_error(grads[name], grads_ref[name]) < 1e-3, name
    if "cg_tol" in run_kw:  # the tolerance stopped tokens early, in the forward and the adjoint solve
        assert info["iterations"] < 30 and info["adjoint_iterations"] < 30


def test_bfloat16_inputs_are_solved_in_float32():
    """bf16 q, k, v: the kernels solve in fp32 whatever the input dtype. Asked for an fp32 output, the forward
    (x and the readout G_t x_t) and the adjoint solve are within 1e-4 of the float64 exact solve of the rounded
    inputs; through mesa, the bf16 output and gradients are within bf16 rounding of it."""
    T, reset = 37, make_reset(37, RESETS)
    x = make_inputs(T, state=True)
    for name in ("q", "k", "v"):
        x[name] = x[name].bfloat16()
    out_ref, _, grads_ref = exact(x, reset)
    # The kernels directly, with fp32 results.
    k, v = x["k"], x["v"]
    states = [mesa_triton.chunk_entry_states(k, rows, x["log_gamma"], x["beta"], s0, reset, 16, torch.float32)
              for rows, s0 in ((v, x["G0"]), (k, x["H0"]))]
    (G_in, G_T), (H_in, H_T) = states
    solve = lambda rhs, adjoint: mesa_triton.chunk_solve(rhs, k, v, x["log_gamma"], x["beta"], x["lam"], G_in, H_in,
                                                         reset, 16, 30, None, adjoint, torch.float32)
    xs, out, _ = solve(x["q"], adjoint=False)
    assert out.dtype == xs.dtype == torch.float32
    assert relative_error(out, out_ref) < 1e-4
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    e, _, _ = solve(d_out, adjoint=True)
    x64 = {n: t.double() for n, t in x.items()}
    e_ref = exact_adjoint(x64, d_out.double(), reset)
    assert relative_error(xs, exact_solution(x64, reset)) < 1e-4
    assert relative_error(e, e_ref) < 1e-4
    # Through mesa: the output and the gradients come back in bf16.
    out, (G, Hs), grads, _ = run(x, reset)
    assert out.dtype == torch.bfloat16 and G.dtype == Hs.dtype == torch.float32
    assert relative_error(out, out_ref) < 4e-3  # bf16 rounding of the output: 2^-9 relative at most
    for name in NAMES:
        assert relative_error(grads[name], grads_ref[name]) < 4e-3, name


def materialised(x, reset):
    """H_t + diag(lam) and G_t for every step, [B, T, H, K, K] and [B, T, H, V, K], float64."""
    G, Hs, As, Gs = x["G0"], x["H0"], [], []
    for t in range(x["q"].shape[1]):
        gamma = x["log_gamma"][:, t].exp() * (~reset[:, t]).double()[:, None]
        k_beta = x["beta"][:, t, :, None] * x["k"][:, t]
        G = gamma[..., None, None] * G + x["v"][:, t, :, :, None] * k_beta[:, :, None, :]
        Hs = gamma[..., None, None] * Hs + k_beta[:, :, :, None] * x["k"][:, t, :, None, :]
        As.append(Hs + torch.diag_embed(x["lam"]))
        Gs.append(G)
    return torch.stack(As, 1), torch.stack(Gs, 1)


def exact_solution(x, reset):
    A, _ = materialised(x, reset)
    return torch.linalg.solve(A, x["q"][..., None])[..., 0]


def exact_adjoint(x, d_out, reset):
    """e_t = A_t^{-1} G_t^T do_t."""
    A, G = materialised(x, reset)
    return torch.linalg.solve(A, (G.mT @ d_out[..., None]))[..., 0]


def test_step_for_step_the_torch_code():
    """In float64 the kernels run the torch code's CG: a truncated solve (5 steps, far from converged) and one with
    a tolerance give the same outputs, states and gradients to 1e-10, and the same statistics (mean CG steps exactly:
    each token stops where the torch code's does)."""
    T, reset = 37, make_reset(37, RESETS)
    x = make_inputs(T, state=True, dtype=torch.float64)
    for kw in (dict(cg_steps=5), dict(cg_tol=1e-3)):
        out, (G, Hs), grads, info = run(x, reset, **kw)
        out_t, (G_t, H_t), grads_t, info_t = run(x, reset, backend="torch", **kw)
        assert relative_error(out, exact(x, reset)[0]) > 1e-6  # truncated: the comparison below is not the solve's
        torch.testing.assert_close(out, out_t, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close((G, Hs), (G_t, H_t), rtol=1e-10, atol=1e-10)
        for name in NAMES:
            torch.testing.assert_close(grads[name], grads_t[name], rtol=1e-10, atol=1e-10, msg=name)
        assert info.keys() == info_t.keys()
        for key in info:
            if key.endswith("iterations_run"):  # a program stops with its chunk's last token, the torch loop with T's
                assert info[key] <= info_t[key] and info[key] >= info[key[:-4]]
                assert (info[key] == info_t[key]) == ("cg_tol" not in kw), key
                continue
            tol = 0 if "iterations" in key or key == "diag_ratio" else 1e-10
            torch.testing.assert_close(info[key], info_t[key], rtol=tol, atol=tol, msg=key)


def test_the_steps_run_are_each_programs_slowest_tokens():
    """The FLOP count's CG steps for the kernels: each program (a chunk of one batch and head) runs until its slowest
    token has converged; the mean over the programs, per token. T = 5 in chunks of 2: programs [1, 4], [2, 0], [3]."""
    from lm.ops.mesa import _run_per_program

    iterations = torch.tensor([[[1.0, 4, 2, 0, 3]], [[0.0, 0, 5, 1, 1]]])  # [B, H, T]
    assert float(_run_per_program(iterations, 2)) == (4 + 2 + 3 + 0 + 5 + 1) / 6


def test_cg_steps_zero_is_linear_attention():
    x = make_inputs(21, state=True, dtype=torch.float64)
    out, states, grads, _ = run(x, cg_steps=0)
    out_t, states_t, grads_t, _ = run(x, backend="torch", cg_steps=0)
    torch.testing.assert_close((out, states, grads), (out_t, states_t, grads_t), rtol=0, atol=0)


def test_mixer_on_the_triton_backend():
    """The Mesa mixer with backend="triton" computes what it computes with the torch code, gradients included, and
    logs the same CG statistics."""
    torch.manual_seed(0)
    mixers = [Mesa(32, 2, 16, 0, backend=backend) for backend in ("triton", "torch")]
    mixers[1].load_state_dict(mixers[0].state_dict())
    x = torch.randn(2, 19, 32)
    reset = make_reset(19, [(0, 7), ()])
    results = []
    for mixer in mixers:
        xi = x.clone().requires_grad_()
        y, _ = mixer(xi, reset=reset)
        y.square().sum().backward()
        results.append((y, xi.grad, [p.grad for p in mixer.parameters()], mixer.metrics()))
    (y, dx, dp, metrics), (y_t, dx_t, dp_t, metrics_t) = results
    torch.testing.assert_close(y, y_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_t, rtol=1e-4, atol=1e-5)
    for a, b in zip(dp, dp_t):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert metrics.keys() == metrics_t.keys() and metrics["cg_iterations"] == metrics_t["cg_iterations"]


def test_backend_resolution(monkeypatch):
    """"auto": the kernels for CUDA tensors where Triton imports and they take the head sizes, the torch code
    otherwise (said once on CUDA); "triton" refuses CPU tensors unless the interpreter is on, head sizes the kernels
    cannot hold, and a missing Triton."""
    warn_once.cache_clear()  # another test may have said the same once already
    K, V = 128, 256  # the largest the kernels take
    assert _resolve_backend("auto", False, K, V) == "torch"
    assert _resolve_backend("auto", True, K, V) == "triton"
    with pytest.raises(ValueError, match="backend"):
        _resolve_backend("cuda", True, K, V)
    with pytest.raises(ValueError, match="K <= 128"):
        _resolve_backend("triton", True, 256, V)
    with pytest.warns(UserWarning, match="torch code on CUDA.*K <= 128 and V <= 256.*V=512"):
        assert _resolve_backend("auto", True, K, 512) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _resolve_backend("triton", False, K, V)
    assert _resolve_backend("triton", True, K, V) == "triton"
    monkeypatch.setattr(sys.modules["lm.ops.mesa"], "_triton_kernels", lambda: None)
    with pytest.raises(RuntimeError, match="needs Triton"):
        _resolve_backend("triton", True, K, V)
    with pytest.warns(UserWarning, match="Triton does not import"):
        assert _resolve_backend("auto", True, K, V) == "torch"


def test_kernel_chunk():
    """The chunk rounds up to a power of two of at least 16 and stays within what fits on chip."""
    assert [mesa_triton.kernel_chunk(c, 16, 16) for c in (1, 16, 19, 64, 128)] == [16, 16, 32, 64, 64]
    assert [mesa_triton.kernel_chunk(64, K, V) for K, V in ((64, 64), (128, 128), (64, 256))] == [64, 32, 32]


def test_kernels_compile_for_hopper():
    """The interpreter runs what Triton's compiler might reject: `python -m lm.bench.kernel_resources` compiles both
    kernels for sm_90 (no GPU needed) and reports what a program asks of an SM, in a process of its own (this one
    has the interpreter on)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "lm.bench.kernel_resources", "--shapes", "16,16,16"], env=env,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| forward solve", "| adjoint solve", "| entry states"]
    assert all(" | yes | " in row for row in rows)  # each fits an SM's shared memory

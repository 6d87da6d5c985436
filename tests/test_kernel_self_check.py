"""Fast paths check themselves (lm.ops.self_check): the first use of a fast kernel per device and shape class runs it
once against the torch code on a small seeded input; a disagreement is said once, with the figures, and the torch code
runs from then on. On the CPU the Mesa Triton kernels (backend="triton", run by Triton's interpreter) go through the
check as on CUDA; the generic mechanism is tested with plain functions."""

import json
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lm.ops import self_check
from lm.ops.common import warn_once
from lm.ops.self_check import ENV, checked, verdicts

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CUDA is here: tests/test_ops_gpu_mesa.py checks the kernels")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No verdict, no notice said, and the check on (whatever the environment says)."""
    monkeypatch.delenv(ENV, raising=False)
    self_check.forget()
    warn_once.cache_clear()
    yield
    self_check.forget()
    warn_once.cache_clear()


# ----------------------------------------------------------------------------------------------------------------------
# Mesa's Triton kernels, under the interpreter


def mesa_inputs(T=19, K=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    return dict(q=F.normalize(rand(2, T, 2, K), dim=-1), k=F.normalize(rand(2, T, 2, K), dim=-1), v=rand(2, T, 2, K),
                log_gamma=F.logsigmoid(rand(2, T, 2) + 3), beta=torch.sigmoid(rand(2, T, 2)),
                lam=0.25 + F.softplus(rand(2, K)))


def run_mesa(x, backend="triton", **kw):
    """mesa's output and the gradients of its sum of squares w.r.t. q, k, v."""
    pytest.importorskip("triton")
    from lm.ops.mesa import mesa

    leaves = {n: t.clone().requires_grad_(n in "qkv") for n, t in x.items()}
    out, _ = mesa(*leaves.values(), chunk_size=16, backend=backend, **kw)
    grads = torch.autograd.grad(out.square().sum(), [leaves[n] for n in "qkv"])
    return out.detach(), grads


@pytest.fixture
def triton_calls(monkeypatch):
    """Counts the calls of the Triton solve (the forward's and the adjoint's), and can break them: calls["break"] set
    to "forward" or "adjoint" scales that solve's result by 1.01."""
    pytest.importorskip("triton")
    from lm.ops import mesa_triton

    solve, calls = mesa_triton.chunk_solve, {"n": 0, "break": None}

    def counted(*args, adjoint, **kw):
        calls["n"] += 1
        x, out, stats = solve(*args, adjoint=adjoint, **kw)
        if calls["break"] == ("adjoint" if adjoint else "forward"):
            x, out = (x * 1.01, out) if adjoint else (x, out * 1.01)
        return x, out, stats

    monkeypatch.setattr(mesa_triton, "chunk_solve", counted)
    return calls


@needs_interpreter
def test_the_triton_kernels_pass_and_are_kept(triton_calls, recwarn, monkeypatch):
    """The real kernels agree with the torch code: no notice, one verdict (within the bounds the GPU test uses), and
    the call's result is the kernels' (as with the check off)."""
    x = mesa_inputs()
    out, grads = run_mesa(x)
    assert not [w for w in recwarn.list if "disagrees" in str(w.message)]
    [(key, verdict)] = verdicts().items()
    assert key[:2] == ("mesa_triton", "cpu") and verdict.ok and verdict.seconds > 0
    assert {"out", "G", "H", "dq", "dk", "dv", "dlog_gamma", "dbeta", "dlam", "dG0", "dH0"} <= verdict.errors.keys()
    bound = self_check.BOUNDS["mesa_triton"][torch.float32]
    assert all(rel <= limit for rel, _, limit in verdict.errors.values())
    assert verdict.errors["out"][2] == bound.out and verdict.errors["dq"][2] == bound.grad
    calls = triton_calls["n"]
    monkeypatch.setenv(ENV, "0")
    unchecked, unchecked_grads = run_mesa(x)
    assert triton_calls["n"] > calls  # the kernels ran the call
    torch.testing.assert_close((out, grads), (unchecked, unchecked_grads), rtol=0, atol=0)


@needs_interpreter
@pytest.mark.parametrize("broken", ["forward", "adjoint"])
def test_a_wrong_kernel_is_caught_once(triton_calls, broken):
    """A solve made wrong by 1% (the output, or the adjoint that gives the gradients): one notice with the figures,
    the call's result (output and gradients) is the torch code's, and a second call neither says it again nor checks
    again."""
    triton_calls["break"] = broken
    x = mesa_inputs()
    want = run_mesa(x, backend="torch")
    tensor = "out" if broken == "forward" else "dq"
    figures = rf"{tensor}: relative error \S+ \(bound 1e-0[34]\), max abs error \S+"
    with pytest.warns(UserWarning, match=rf"mesa_triton: the fast kernel disagrees with the torch code on cpu.*"
                                         rf"{figures}.*torch code runs these calls from now on \({ENV}=0"):
        got = run_mesa(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    [verdict] = verdicts().values()
    assert not verdict.ok
    rel, max_abs, limit = verdict.errors[tensor]
    assert rel > limit and max_abs > 0
    calls = triton_calls["n"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = run_mesa(x)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    assert triton_calls["n"] == calls and len(verdicts()) == 1


@needs_interpreter
def test_each_shape_class_is_checked_once(triton_calls):
    """The verdict is kept per shape class: resets, or a tolerance, take other code paths of the kernels and are
    checked anew; the same class again is not, whatever the batch and length of the call."""
    x = mesa_inputs()
    run_mesa(x)
    reset = torch.zeros(2, 19, dtype=torch.bool)
    reset[:, 7] = True
    run_mesa(x, reset=reset)
    assert len(verdicts()) == 2
    run_mesa(x, cg_tol=1e-4)
    assert len(verdicts()) == 3
    calls = triton_calls["n"]
    run_mesa(mesa_inputs(T=40, seed=1), reset=torch.zeros(2, 40, dtype=torch.bool))
    assert len(verdicts()) == 3 and triton_calls["n"] == calls + 2  # the call's own forward and adjoint solves
    assert all(v.ok for v in verdicts().values())
    classes = [key[2] for key in verdicts()]
    assert [c[-2:] for c in classes] == [(False, False), (True, False), (False, True)]


@needs_interpreter
def test_the_setting_turns_the_check_off(triton_calls, monkeypatch, recwarn):
    """LM_KERNEL_SELF_CHECK=0: no check, so a wrong kernel runs as asked, silently."""
    monkeypatch.setenv(ENV, "0")
    triton_calls["break"] = "forward"
    x = mesa_inputs()
    got, _ = run_mesa(x)
    want, _ = run_mesa(x, backend="torch")
    torch.testing.assert_close(got, 1.01 * want, rtol=1e-5, atol=1e-6)
    assert not verdicts() and not [w for w in recwarn.list if "disagrees" in str(w.message)]
    assert triton_calls["n"] == 2  # the call's forward and adjoint solves, no check's


# ----------------------------------------------------------------------------------------------------------------------
# the mechanism


def small_input(g):
    return {"x": self_check.normal(g, 3, 5).requires_grad_()}


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_check_runs_apart_from_the_caller(mode):
    """Under no_grad or inference_mode, and autocast: the check differentiates (grad on, autocast off), leaves the
    global RNG and the caller's graph as they were, and compares gradients too (a wrong gradient is caught)."""
    seen = []

    def fast(x):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), x.requires_grad))
        return x * 2

    w = torch.ones(3, requires_grad=True)
    y = w * 3  # the caller's graph, half built
    rng = torch.get_rng_state()
    with mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert checked("double", "cpu", "class", fast, lambda x: x + x, small_input, torch.float32,
                       bounds="mesa_triton")
    assert seen == [(True, False, True)]
    assert torch.equal(torch.get_rng_state(), rng)
    y.sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 3.0))
    verdict = verdicts()[("double", "cpu", "class")]
    assert verdict.errors.keys() == {"out", "dx"} and verdict.errors["dx"][0] == 0
    # The output right, its gradient wrong: caught.
    wrong_grad = lambda x: 2 * x.detach() + 0.01 * (x - x.detach())
    with pytest.warns(UserWarning, match=r"dx: relative error 1\.0e\+00 \(bound 1e-03\)"):
        assert not checked("wrong gradient", "cpu", "class", wrong_grad, lambda x: x + x, small_input, torch.float32,
                           bounds="mesa_triton")


def test_nan_fails_and_a_nested_call_runs_the_fast_path():
    """A NaN anywhere fails the check; while a kernel's check runs, a nested use of the same kernel (the fast function
    calling the public op) takes the fast path without a second check."""
    nested = []

    def fast(x):
        nested.append(checked("nan", "cpu", "class", fast, None, small_input, torch.float32, bounds="fla"))
        return x * float("nan")

    with pytest.warns(UserWarning, match="out: relative error nan"):
        assert not checked("nan", "cpu", "class", fast, lambda x: x, small_input, torch.float32, bounds="fla")
    assert nested == [True] and len(verdicts()) == 1


def test_a_compiled_caller_checks_once_then_compiles():
    """At a dispatch point inside torch.compile, the first call runs the check eagerly and the verdict is then
    traced as a constant: a wrong kernel's caller compiles to the torch code, checked once."""
    calls = []

    def wrong(x):
        calls.append(1)
        return x * 3

    def op(x):
        if checked("compiled caller", x.device, x.shape[-1], wrong, lambda x: x * 2, small_input, x.dtype,
                   bounds="fla"):
            return x * 3
        return x * 2

    compiled = torch.compile(op, backend="eager")
    x = torch.randn(4, 5)
    with pytest.warns(UserWarning, match="compiled caller: the fast kernel disagrees"):
        torch.testing.assert_close(compiled(x), x * 2)
    torch.testing.assert_close(compiled(x + 1), (x + 1) * 2)
    assert len(calls) == 1 and len(verdicts()) == 1


def test_the_gpu_tests_read_the_same_table():
    """One table of bounds: the GPU tests take theirs from lm.ops.self_check.BOUNDS, not copies."""
    tests = Path(__file__).parent
    for name in ("test_ops_gpu.py", "test_ops_gpu_mesa.py", "test_ops_gpu_mlstm.py", "test_model_gpu.py",
                 "test_flex_attention.py"):
        assert "BOUNDS[" in (tests / name).read_text(), name



# ----------------------------------------------------------------------------------------------------------------------
# every dispatch point, with its kernel stood in for by the torch code made 10% wrong (the kernels need CUDA; bf16's
# bounds are 2e-2 and more)


def wrong(result):
    """The torch code's result, 10% off: every tensor of it scaled by 1.1."""
    if torch.is_tensor(result):
        return 1.1 * result
    return type(result)(wrong(t) for t in result)


def bf16(g_seed, *shape, unit=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(g_seed))
    return (F.normalize(t, dim=-1) if unit else t).bfloat16()


def linear_attention_case(monkeypatch, per_key):
    module = sys.modules["lm.ops.linear_attention"]  # lm.ops.linear_attention may be the function

    monkeypatch.setattr(module, "use_fla", lambda backend, *tensors, **kw: backend == "fla")
    monkeypatch.setattr(module, "fla_linear_attention", lambda q, k, v, log_gamma, beta, scale, state, reset: wrong(
        module.linear_attention(q, k, v, log_gamma, beta, scale, initial_state=state, reset=reset, backend="torch")))
    reset = torch.zeros(1, 20, dtype=torch.bool)
    reset[0, 9] = True
    log_gamma = F.logsigmoid(torch.randn(1, 20, 2, *([8] if per_key else [])) + 3)
    x = (bf16(0, 1, 20, 2, 8), bf16(1, 1, 20, 2, 8, unit=True), bf16(2, 1, 20, 2, 8), log_gamma)
    return lambda backend: module.linear_attention(*x, scale=0.3, reset=reset, backend=backend)


def delta_rule_case(monkeypatch):
    module = sys.modules["lm.ops.delta_rule"]  # lm.ops.delta_rule may be the function

    monkeypatch.setattr(module, "use_fla", lambda backend, *tensors, **kw: backend == "fla")
    monkeypatch.setattr(module, "fla_delta_rule", lambda q, k, v, beta, log_alpha, scale, state, reset: wrong(
        module.delta_rule(q, k, v, beta, log_alpha, scale, initial_state=state, reset=reset, backend="torch")))
    x = (bf16(0, 1, 20, 2, 8), bf16(1, 1, 20, 2, 8, unit=True), bf16(2, 1, 20, 2, 8), torch.rand(1, 20, 2).bfloat16(),
         F.logsigmoid(torch.randn(1, 20, 2) + 3))
    return lambda backend: module.delta_rule(*x, scale=0.3, initial_state=torch.zeros(1, 2, 8, 8), backend=backend)


def diagonal_scan_case(monkeypatch):
    module = sys.modules["lm.ops.diagonal_scan"]  # lm.ops.diagonal_scan may be the function

    monkeypatch.setattr(module, "use_fla", lambda backend, *tensors, **kw: backend == "fla")
    monkeypatch.setattr(module, "fla_diagonal_scan", lambda x, log_a, state, reset: wrong(
        module.diagonal_scan(x, log_a, initial_state=state, reset=reset, backend="torch")))
    x, log_a = bf16(0, 1, 20, 16), F.logsigmoid(torch.randn(1, 20, 16))
    return lambda backend: module.diagonal_scan(x, log_a, backend=backend)


def mlstm_case(monkeypatch):
    module = sys.modules["lm.ops.mlstm"]  # lm.ops.mlstm may be the function

    monkeypatch.setattr(module, "_use_mlstm_kernels", lambda backend, *args: backend == "mlstm_kernels")
    monkeypatch.setattr(module, "_mlstm_kernels_chunkwise", lambda *args: wrong(module._chunkwise(*args)))
    x = (bf16(0, 1, 32, 2, 16), bf16(1, 1, 32, 2, 16), bf16(2, 1, 32, 2, 16), bf16(3, 1, 32, 2), bf16(4, 1, 32, 2))
    return lambda backend: module.mlstm(*x, chunk_size=16, backend=backend)


def liger_case(monkeypatch):
    from lm.ops import cross_entropy as module

    fused = lambda x, w, y, ignore_index, reduction, softcap: wrong(
        module.head_cross_entropy_reference(x, w, y, softcap))
    monkeypatch.setattr(module, "liger_loss", lambda: fused)
    x, w = torch.randn(40, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(0))
    return lambda backend: module.head_cross_entropy(x, w, y, soft_cap=5.0, backend=backend)


CASES = {
    "linear_attention (fla chunk_simple_gla)": lambda mp: linear_attention_case(mp, per_key=False),
    "linear_attention (fla chunk_gla)": lambda mp: linear_attention_case(mp, per_key=True),
    "delta_rule (fla chunk_gated_delta_rule)": delta_rule_case,
    "diagonal_scan (fla fused_recurrent_hgrn)": diagonal_scan_case,
    "mlstm (mlstm_kernels chunkwise--triton_xl_chunk)": mlstm_case,
    "head cross-entropy (liger fused linear cross-entropy)": liger_case,
}
FAST = {"linear_attention": "fla", "delta_rule": "fla", "diagonal_scan": "fla", "mlstm": "mlstm_kernels",
        "head cross-entropy": "liger"}


@pytest.mark.parametrize("name", CASES)
def test_each_dispatch_point_checks_its_kernel(name, monkeypatch):
    """Each op's dispatch runs its kernel's check (its seeded input, its bound): a kernel 10% off is caught, and
    the call then computes the torch code's result."""
    call = CASES[name](monkeypatch)
    fast = FAST[name.split(" (")[0]]
    with pytest.warns(UserWarning, match=rf"{re.escape(name)}: the fast kernel disagrees.*relative error"):
        got = call(fast)
    torch.testing.assert_close(got, call("torch"), rtol=0, atol=0)
    [(key, verdict)] = verdicts().items()
    assert key[0] == name and not verdict.ok


def test_flex_attention_checks_its_compiled_kernel(monkeypatch):
    """FlexAttention's check (its masks: a window with grouped heads, documents, a cache), with the compiled kernel
    stood in for by the math form, right and then 10% off."""
    from lm.mixers import flex_masks

    monkeypatch.setattr(flex_masks, "compiled", lambda fn, dynamic=None: lambda q, k, v, block_mask, enable_gqa:
                        factor * flex_masks.flex_math(q, k, v, block_mask, enable_gqa))
    q, k = bf16(0, 1, 4, 9, 16), bf16(1, 1, 2, 12, 16)
    factor = 1.0
    assert flex_masks.flex_agrees(q, k, True, 64, False) and flex_masks.flex_agrees(q, k, False, None, True)
    factor = 1.1
    with pytest.warns(UserWarning, match=r"FlexAttention \(compiled\): the fast kernel disagrees.*out: relative"):
        assert not flex_masks.flex_agrees(q, k, True, None, True)
    assert [v.ok for v in verdicts().values()] == [True, True, False]


@needs_interpreter
def test_the_cost_bench(capsys):
    """`lm bench self-check` (docs/performance.md, "Kernel self-check"): the seconds of one check and of the call it
    guards, and the check's worst error."""
    pytest.importorskip("triton")
    from lm.cli import main

    assert main(["bench", "self-check", "--T", "20", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["check_s"] > 0 and result["call_s"] > 0 and result["worst_relative_error"] < 1e-4

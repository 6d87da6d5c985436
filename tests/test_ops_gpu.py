"""GPU only: flash-linear-attention's kernels (backend="fla") against the pure-PyTorch ops (backend="torch") in bf16,
with an initial state, the final state and gradients. Skipped without CUDA; with CUDA, a missing fla is an error."""

import pytest
import torch
from gpu_helpers import err_ratio, raw_kernels, require_gpu  # noqa: F401 (raw_kernels: an autouse fixture)

from lm.ops.delta_rule import delta_rule
from lm.ops.diagonal_scan import diagonal_scan
from lm.ops.fla import fla_refuses_gated_backward
from lm.ops.linear_attention import linear_attention
from lm.ops.self_check import BOUNDS

require_gpu("fla.ops.delta_rule", "fla.ops.gated_delta_rule", "fla.ops.simple_gla", "fla.ops.gla", "fla.ops.hgrn")

B, T, H, K, V = 2, 200, 4, 64, 64  # T not a multiple of fla's chunk size of 64
SCALE = K**-0.5


def make_inputs(gated_decay: bool, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda")
    x = dict(
        q=rand(B, T, H, K).bfloat16(),
        k=torch.nn.functional.normalize(rand(B, T, H, K), dim=-1).bfloat16(),
        v=rand(B, T, H, V).bfloat16(),
        beta=torch.rand(B, T, H, generator=g, device="cuda").bfloat16(),
        log_decay=torch.nn.functional.logsigmoid(rand(B, T, H) + 3) if gated_decay else None,  # float32
        initial_state=rand(B, H, K, V) * 0.1,  # float32
    )
    return {n: t if t is None else t.requires_grad_() for n, t in x.items()}


def run_and_grads(op, x: dict, backend: str):
    """Output, final state and the gradients of a random projection of both, w.r.t. every input."""
    out, state = op(x, backend)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    g = torch.Generator(device="cuda").manual_seed(1)
    loss = (out.float() * torch.randn(out.shape, generator=g, device="cuda")).sum()
    loss = loss + (state * torch.randn(state.shape, generator=g, device="cuda")).sum()
    inputs = {n: t for n, t in x.items() if t is not None}
    grads = torch.autograd.grad(loss, list(inputs.values()))
    return out, state, dict(zip(inputs, grads))


def check_against_torch(op, x: dict, tol: float = BOUNDS["fla"][torch.bfloat16].out,
                        gated_kernel: str | None = None):
    """fla against torch: the forward always (output and final state, without a gradient: what evaluation and
    generation run), and the gradients where fla differentiates. For a gated kernel whose backward fla refuses here
    (Triton 3.4 to 3.7.0 on Hopper, as on the lent H200), that fla raises and that "auto" then takes the torch code."""
    with torch.no_grad():
        out, state = op(x, "fla")
        out_ref, state_ref = op(x, "torch")
    assert err_ratio(out, out_ref) < tol
    assert err_ratio(state, state_ref) < tol
    if gated_kernel and fla_refuses_gated_backward(gated_kernel):
        with pytest.raises(RuntimeError, match="3.7.1"):
            run_and_grads(op, x, "fla")
        auto, torch_code = run_and_grads(op, x, "auto"), run_and_grads(op, x, "torch")
        torch.testing.assert_close(auto[0], torch_code[0], rtol=0, atol=0)
        return
    out, state, grads = run_and_grads(op, x, "fla")
    out_ref, state_ref, grads_ref = run_and_grads(op, x, "torch")
    assert err_ratio(out, out_ref) < tol
    assert err_ratio(state, state_ref) < tol
    for name in grads_ref:
        assert err_ratio(grads[name], grads_ref[name]) < tol, name


def _linear_attention(x, backend, reset=None):
    return linear_attention(
        x["q"], x["k"], x["v"], x["log_decay"], x["beta"], SCALE, initial_state=x["initial_state"], reset=reset,
        backend=backend,
    )


def _delta_rule(x, backend, reset=None):
    return delta_rule(
        x["q"], x["k"], x["v"], x["beta"], x["log_decay"], SCALE, initial_state=x["initial_state"], reset=reset,
        backend=backend,
    )


def packed_documents() -> torch.Tensor:
    """[B, T] resets: row 0 carries its state into a first document, then one-token documents and one across fla's
    chunk boundary; row 1 starts with a reset (its initial state unused) and ends with a one-token document."""
    reset = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    reset[0, [50, 51, 130]] = True
    reset[1, [0, 64, 199]] = True
    return reset


def test_linear_attention_fla_matches_torch():
    check_against_torch(_linear_attention, make_inputs(gated_decay=True), gated_kernel="simple_gla")


@pytest.mark.parametrize("gated", [True, False], ids=["gated_deltanet", "deltanet"])
def test_delta_rule_fla_matches_torch(gated):
    check_against_torch(_delta_rule, make_inputs(gated_decay=gated), gated_kernel="gated_delta_rule" if gated else None)


def test_linear_attention_per_key_decay_fla_matches_torch():
    """GLA: log_gamma [B, T, H, K] goes to fla's chunk_gla."""
    x = make_inputs(gated_decay=True)
    g = torch.Generator(device="cuda").manual_seed(2)
    log_decay = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=g, device="cuda") + 3)
    check_against_torch(_linear_attention, dict(x, log_decay=log_decay.requires_grad_()))


def test_diagonal_scan_fla_matches_torch():
    """diagonal_scan through fla's fused_recurrent_hgrn, with inputs as fla's own hgrn test builds them."""
    D = H * K
    g = torch.Generator(device="cuda").manual_seed(3)
    gate = torch.randn(B, T, D, generator=g, device="cuda")
    x = dict(
        x=((1 - gate.sigmoid()) * torch.randn(B, T, D, generator=g, device="cuda")).bfloat16().requires_grad_(),
        log_a=torch.nn.functional.logsigmoid(gate).requires_grad_(),  # float32
        initial_state=torch.randn(B, D, generator=g, device="cuda").requires_grad_(),
    )
    op = lambda x, backend: diagonal_scan(x["x"], x["log_a"], initial_state=x["initial_state"], backend=backend)
    check_against_torch(op, x)


@pytest.mark.parametrize("op", ["linear_attention", "gated_deltanet", "deltanet", "gla"])
def test_resets_go_through_fla_varlen(op):
    """Packed documents on the fla path (cu_seqlens, lm.ops.fla._varlen_call) against the torch path with resets."""
    reset = packed_documents()
    x = make_inputs(gated_decay=op != "deltanet")
    if op == "gla":
        g = torch.Generator(device="cuda").manual_seed(2)
        x["log_decay"] = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=g, device="cuda") + 3)
        x["log_decay"].requires_grad_()
    fn = _delta_rule if op.endswith("deltanet") else _linear_attention
    kernel = {"linear_attention": "simple_gla", "gated_deltanet": "gated_delta_rule"}.get(op)
    check_against_torch(lambda x, backend: fn(x, backend, reset), x, gated_kernel=kernel)


def test_auto_uses_fla_for_cuda_bf16():
    from lm.ops.fla import use_fla

    x = make_inputs(gated_decay=True)
    assert use_fla("auto", x["q"], op="test")
    assert not use_fla("auto", x["q"].float(), op="test")  # float32 stays on the exact torch path


def test_the_self_check_keeps_fla(monkeypatch):
    """With the self-check on (lm.ops.self_check), each fla kernel passes it here: a verdict per kernel and shape
    class, all kept, none said. Named "fla" is checked as "auto" is; forward only where fla refuses the backward."""
    from lm.ops import self_check

    monkeypatch.setenv("LM_KERNEL_SELF_CHECK", "1")
    self_check.forget()
    x, reset = make_inputs(gated_decay=True), packed_documents()
    per_key = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda") + 3)
    gate = torch.randn(B, T, H * V, device="cuda")
    with torch.no_grad():  # the check differentiates anyway; the calls' own forwards then never meet a refusal
        _linear_attention(x, "fla")
        _linear_attention(x, "fla", reset)
        _linear_attention(dict(x, log_decay=per_key), "fla")
        _delta_rule(x, "fla")
        _delta_rule(dict(x, log_decay=None), "fla", reset)
        diagonal_scan(((1 - gate.sigmoid()) * gate).bfloat16(), torch.nn.functional.logsigmoid(gate), backend="fla")
    found = self_check.verdicts()
    print("\nself-check seconds:", {key[0]: round(v.seconds, 2) for key, v in found.items()})
    assert len(found) == 6 and all(v.ok for v in found.values()), found

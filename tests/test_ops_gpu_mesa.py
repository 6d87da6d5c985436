"""GPU only: mesa's Triton kernels (backend "triton", which "auto" takes on CUDA) against the float64 exact solve and
against fla's chunk_mesa_net; the optional fla backend against the torch code in bf16, with an initial state, the
final state and gradients; and the torch code itself on CUDA. Skipped without CUDA; with CUDA, a missing
fla.ops.mesa_net or Triton is an error. tests/test_op_mesa_triton.py runs the same kernels on the CPU, interpreted.

fla's CG is not step-for-step ours (other warm start, +1e-5 in its step-size denominators, see lm/ops/fla_mesa.py),
so the comparison runs enough steps for both to converge; what remains is bf16 rounding."""

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import err_ratio, raw_kernels, require_gpu  # noqa: F401 (raw_kernels: an autouse fixture)

from lm.ops.mesa import mesa
from lm.ops.self_check import BOUNDS

require_gpu("fla.ops.mesa_net", "triton")

B, T, H, K = 2, 200, 4, 64  # V == K (fla's kernel); T not a multiple of fla's chunk size of 64


def make_inputs(dtype=torch.bfloat16, seed=0) -> dict:
    """The paper's setting: L2-normalised q, k; beta = sigmoid, gamma = sigmoid(. + 3); lam = 0.25 + softplus; a
    small random state with H_0 symmetric positive semi-definite."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda")
    M = rand(B, H, K, K)
    x = dict(
        q=F.normalize(rand(B, T, H, K), dim=-1).to(dtype),
        k=F.normalize(rand(B, T, H, K), dim=-1).to(dtype),
        v=rand(B, T, H, K).to(dtype),
        log_gamma=F.logsigmoid(rand(B, T, H) + 3),  # float32
        beta=torch.sigmoid(rand(B, T, H)),
        lam=0.25 + F.softplus(rand(H, K)),
        G0=rand(B, H, K, K) * 0.1,
        H0=M @ M.mT / K,
    )
    return {n: t.requires_grad_() for n, t in x.items()}


def run_and_grads(x: dict, backend: str = "torch", cg_steps: int = 30):
    """Output, final state and the gradients of a fixed random projection of all three, w.r.t. every input."""
    out, (G, Hs) = mesa(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], x["lam"], cg_steps=cg_steps,
                        initial_state=(x["G0"], x["H0"]), backend=backend)
    g = torch.Generator().manual_seed(1)  # on the CPU, so that CUDA and CPU runs use the same weights
    weight = lambda t: torch.randn(t.shape, generator=g).to(t.device, torch.float32)
    loss = (out.float() * weight(out)).sum() + (G.float() * weight(G)).sum() + (Hs.float() * weight(Hs)).sum()
    grads = torch.autograd.grad(loss, list(x.values()))
    return out, (G, Hs), dict(zip(x, grads))


def test_fla_matches_torch():
    x = make_inputs()
    out, (G, Hs), grads = run_and_grads(x, "fla")
    out_ref, (G_ref, H_ref), grads_ref = run_and_grads(x, "torch")
    assert out.dtype == torch.bfloat16 and G.dtype == Hs.dtype == torch.float32
    assert G.shape == (B, H, K, K) and Hs.shape == (B, H, K, K)
    errors = {"out": err_ratio(out, out_ref), "G": err_ratio(G, G_ref), "H": err_ratio(Hs, H_ref)}
    errors.update({f"d{n}": err_ratio(grads[n], grads_ref[n]) for n in grads_ref})
    max_diff = {"out": (out.float() - out_ref.float()).abs().max().item()}
    max_diff.update({f"d{n}": (grads[n].float() - grads_ref[n].float()).abs().max().item() for n in grads_ref})
    print("\nfla vs torch, relative RMS error:", {n: f"{e:.2e}" for n, e in errors.items()})
    print("fla vs torch, max abs difference:", {n: f"{e:.2e}" for n, e in max_diff.items()})
    for name, err in errors.items():
        assert err < BOUNDS["fla_mesa"][torch.bfloat16].out, (name, err)


def test_fla_refuses_what_it_cannot_do():
    x = make_inputs()
    args = (x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], x["lam"])
    with pytest.raises(NotImplementedError, match="cg_tol"):
        mesa(*args, cg_tol=1e-4, backend="fla")
    with pytest.raises(TypeError, match="bf16"):
        mesa(*(t.float() for t in args), backend="fla")


def test_torch_code_on_cuda_matches_cpu_float64():
    x = make_inputs(torch.float32)
    out, (G, Hs), grads = run_and_grads(x)
    x64 = {n: t.detach().cpu().double().requires_grad_() for n, t in x.items()}
    out64, (G64, H64), grads64 = run_and_grads(x64)
    errors = {"out": err_ratio(out.cpu(), out64), "G": err_ratio(G.cpu(), G64), "H": err_ratio(Hs.cpu(), H64)}
    errors.update({f"d{n}": err_ratio(grads[n].cpu(), grads64[n]) for n in grads64})
    print("\ntorch code, CUDA float32 vs CPU float64, relative RMS error:", {n: f"{e:.2e}" for n, e in errors.items()})
    for name, err in errors.items():
        assert err < 1e-3, (name, err)  # TF32 matmuls, if someone enabled them, would be the main error


def test_auto_is_triton_on_cuda():
    x = make_inputs()
    args = (x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], x["lam"])
    out_auto, _ = mesa(*args, backend="auto")
    out_triton, _ = mesa(*args, backend="triton")
    torch.testing.assert_close(out_auto, out_triton, rtol=0, atol=0)


def exact_and_grads(x: dict, reset=None):
    """The float64 exact solve on the CPU (the layer token by token, torch.linalg.solve) of the inputs as given (bf16
    ones rounded), and the gradients of run_and_grads's loss."""
    from test_op_mesa import reference

    x = {n: t.detach().cpu().double().requires_grad_() for n, t in x.items()}
    out, (G, Hs) = reference(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], x["lam"], (x["G0"], x["H0"]),
                             None if reset is None else reset.cpu())
    g = torch.Generator().manual_seed(1)
    weight = lambda t: torch.randn(t.shape, generator=g).double()
    loss = (out * weight(out)).sum() + (G * weight(G)).sum() + (Hs * weight(Hs)).sum()
    return out, (G, Hs), dict(zip(x, torch.autograd.grad(loss, list(x.values()))))


def relative_error(a, b) -> float:
    return ((a.detach().cpu().double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("cg_tol", [None, 1e-5])
def test_triton_matches_the_exact_solve(cg_tol):
    """float32 inputs, a carried state, resets, T not a multiple of the chunk: the output within 1e-4 of the float64
    exact solve and every gradient within 1e-3, as on the CPU (the kernels' products in 3xTF32; plain TF32 would
    miss these bounds)."""
    x = make_inputs(torch.float32)
    reset = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    reset[0, [0, 63, 64, 150]] = True
    out, (G, Hs), info = mesa(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], x["lam"], cg_tol=cg_tol,
                              initial_state=(x["G0"], x["H0"]), reset=reset, backend="triton", return_info=True)
    g = torch.Generator().manual_seed(1)
    weight = lambda t: torch.randn(t.shape, generator=g).to(t.device, torch.float32)
    loss = (out * weight(out)).sum() + (G * weight(G)).sum() + (Hs * weight(Hs)).sum()
    grads = dict(zip(x, torch.autograd.grad(loss, list(x.values()))))
    out_ref, (G_ref, H_ref), grads_ref = exact_and_grads(x, reset)
    errors = {"out": relative_error(out, out_ref), "G": relative_error(G, G_ref), "H": relative_error(Hs, H_ref)}
    errors.update({f"d{n}": relative_error(grads[n], grads_ref[n]) for n in grads_ref})
    print(f"\ntriton (cg_tol {cg_tol}) vs float64 exact, relative error:", {n: f"{e:.1e}" for n, e in errors.items()},
          {n: f"{v.item():.3g}" for n, v in info.items()})
    bound = BOUNDS["mesa_triton"][torch.float32]
    for name, err in errors.items():
        assert err < (bound.out if name in ("out", "G", "H") else bound.grad), (name, err)
    if cg_tol is not None:
        assert info["iterations"] < 30


def test_the_self_check_keeps_the_triton_kernels(monkeypatch):
    """With the self-check on (lm.ops.self_check), "auto" keeps lm's kernels here, in bf16 and float32, with and
    without resets, none said; and named fla's chunk_mesa_net passes its own."""
    from lm.ops import self_check

    monkeypatch.setenv("LM_KERNEL_SELF_CHECK", "1")
    self_check.forget()
    reset = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    reset[0, [0, 63, 150]] = True
    for dtype in (torch.bfloat16, torch.float32):
        x = make_inputs(dtype)
        args = (x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], x["lam"])
        with torch.no_grad():
            mesa(*args)
            mesa(*args, reset=reset)
    x = make_inputs()
    with torch.no_grad():
        mesa(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], x["lam"], backend="fla")
    found = self_check.verdicts()
    print("\nself-check seconds:", {key[0]: round(v.seconds, 2) for key, v in found.items()})
    assert len(found) == 5 and all(v.ok for v in found.values()), found


def test_triton_error_is_a_tenth_of_flas():
    """bf16 inputs, V == K, 30 CG steps each: against the float64 exact solve of the same (rounded) inputs, the
    kernels' output error is at most a tenth of fla's chunk_mesa_net's (fp16 CG, from x = 0). fla returns bf16, whose
    rounding it cannot avoid; lm's kernels get the same values in float32 and return float32, so the comparison is of
    the solves (in training both outputs are rounded to bf16 alike)."""
    x = make_inputs()
    x["G0"], x["H0"] = torch.zeros_like(x["G0"]), torch.zeros_like(x["H0"])
    out_ref = exact_and_grads(x)[0]
    errors = {}
    for backend, dtype in (("triton", torch.float32), ("fla", torch.bfloat16)):
        q, k, v = (x[n].to(dtype) for n in ("q", "k", "v"))  # bf16 -> float32 is exact: the same inputs
        out, _ = mesa(q, k, v, x["log_gamma"], x["beta"], x["lam"], cg_steps=30, backend=backend)
        errors[backend] = relative_error(out.float(), out_ref)
    print("\noutput error against the float64 solve:", {n: f"{e:.2e}" for n, e in errors.items()})
    assert errors["triton"] <= 0.1 * errors["fla"], errors


def test_solve_is_float32_under_lightning_bf16_mixed():
    """As tests/test_op_mesa.py's CPU autocast test, under Lightning's own bf16-mixed forward context on CUDA (where
    TF32 is off, as torch's default for matmuls): the output and input gradients stay within 4x of the plain float32
    call's error against the float64 exact solve."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from test_op_mesa import clustered_inputs, relative_error

    precision = MixedPrecision("bf16-mixed", "cuda")
    x = {n: t.cuda() for n, t in clustered_inputs().items()}
    proj = torch.randn(x["v"].shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))

    def output_and_grads(inputs: dict, mixed: bool) -> list:
        inputs = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
        steps = 64 if inputs["q"].dtype == torch.float64 else 30
        if mixed:
            with precision.forward_context():
                out, _ = mesa(*inputs.values(), cg_steps=steps)
        else:
            out, _ = mesa(*inputs.values(), cg_steps=steps)
        (out * proj.to(out.dtype)).sum().backward()
        return [out.detach().double()] + [t.grad.double() for t in inputs.values()]

    exact = output_and_grads({n: t.double() for n, t in x.items()}, mixed=False)
    plain = output_and_grads(x, mixed=False)
    mixed = output_and_grads(x, mixed=True)
    for name, e, p, m in zip(["out", *x], exact, plain, mixed):
        assert relative_error(m, e) <= 4 * relative_error(p, e) + 1e-12, name

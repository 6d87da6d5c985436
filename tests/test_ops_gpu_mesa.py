"""GPU only: mesa's optional fla backend (flash-linear-attention's chunk_mesa_net, Triton) against the torch code in
bf16, with an initial state, the final state and gradients, and the torch code itself on CUDA. Skipped without CUDA;
with CUDA, a missing fla.ops.mesa_net is an error.

fla's CG is not step-for-step ours (other warm start, +1e-5 in its step-size denominators, see lm/ops/fla_mesa.py),
so the comparison runs enough steps for both to converge; what remains is bf16 rounding."""

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import err_ratio, require_gpu

from lm.ops.mesa import mesa

require_gpu("fla.ops.mesa_net")

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
        assert err < 5e-2, (name, err)


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


def test_auto_is_torch_on_cuda():
    x = make_inputs()
    args = (x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], x["lam"])
    out_auto, _ = mesa(*args, backend="auto")
    out_torch, _ = mesa(*args, backend="torch")
    torch.testing.assert_close(out_auto, out_torch, rtol=0, atol=0)


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

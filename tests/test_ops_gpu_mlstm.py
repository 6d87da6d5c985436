"""lm.ops.mlstm's optional mlstm_kernels backend (Triton, "chunkwise--triton_xl_chunk") against the torch code on a
GPU. Skipped without CUDA; with CUDA, a missing mlstm_kernels is an error. Errors are per-tensor relative RMS errors
(fla's measure), so that a gradient's few large entries do not set the tolerance of the rest."""

import pytest
import torch
from gpu_helpers import err_ratio, raw_kernels, require_gpu  # noqa: F401 (raw_kernels: an autouse fixture)

from lm.ops.mlstm import _use_mlstm_kernels, mlstm
from lm.ops.self_check import BOUNDS

require_gpu("mlstm_kernels.torch")

B, H, K, V = 2, 4, 64, 64


def make_inputs(T, dtype, seed=0, with_state=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda")
    x = dict(
        q=rand(B, T, H, K).to(dtype),
        k=rand(B, T, H, K).to(dtype),
        v=rand(B, T, H, V).to(dtype),
        i_pre=(2 * rand(B, T, H)).to(dtype),
        f_pre=(2 + 1.5 * rand(B, T, H)).to(dtype),
    )
    x = {name: t.requires_grad_() for name, t in x.items()}
    state = (rand(B, H, K, V), rand(B, H, K).abs(), rand(B, H)) if with_state else None
    return x, state


CASES = pytest.mark.parametrize("T, with_state", [(64, False), (256, False), (256, True)])
DTYPES = pytest.mark.parametrize("dtype, tol", [(dtype, BOUNDS["mlstm_kernels"][dtype].out)  # fp32 dots: TF32
                                                 for dtype in (torch.bfloat16, torch.float32)])


def kernel_and_torch(T, dtype, with_state):
    """{backend: (output, final state, gradients of a random projection of the output w.r.t. q, k, v, i, f)}."""
    x, state = make_inputs(T, dtype, with_state=with_state)
    w = torch.randn(B, T, H, V, device="cuda")
    results = {}
    for backend in ("mlstm_kernels", "torch"):
        out, final = mlstm(*x.values(), initial_state=state, chunk_size=64, backend=backend)
        grads = torch.autograd.grad((out.float() * w).sum(), list(x.values()))
        results[backend] = out, final, dict(zip(x, grads))
    return results["mlstm_kernels"], results["torch"]


@DTYPES
@CASES
def test_kernel_output_states_and_gradients_but_dq_match_torch(dtype, tol, T, with_state):
    (out, final, grads), (want, want_final, want_grads) = kernel_and_torch(T, dtype, with_state)
    assert out.dtype == dtype and all(s.dtype == torch.float32 for s in final)
    assert [tuple(s.shape) for s in final] == [(B, H, K, V), (B, H, K), (B, H)]
    assert err_ratio(out, want) < tol
    # The stabiliser m follows the same recursion in both, so the stabilised states compare directly.
    for i, (got, ref) in enumerate(zip(final, want_final)):
        assert err_ratio(got, ref) < tol, f"state {i}"
    for name in ("k", "v", "i_pre", "f_pre"):
        assert torch.isfinite(grads[name]).all(), name
        error = err_ratio(grads[name], want_grads[name])
        assert error < tol, f"d{name}: {error:.2e}"


# On the lent H200 (2026-12-04, mlstm_kernels 2.0.6, Triton 3.6.0) the kernel's dq was far from the torch code's
# (relative RMS error 1.04 at T 64 in bf16; docs/performance.md). The cause, found since on the CPU under Triton's
# interpreter (lm/bench/mlstm_kernels_grad.py): the kernel's backward treats the normaliser as a constant. So "auto"
# never picks the kernel; strict, so that a kernel whose dq agrees fails here and this mark is revisited.
@pytest.mark.xfail(reason="mlstm_kernels' backward treats the normaliser as a constant", strict=True)
@DTYPES
@CASES
def test_kernel_dq_matches_torch(dtype, tol, T, with_state):
    (_, _, grads), (_, _, want_grads) = kernel_and_torch(T, dtype, with_state)
    assert err_ratio(grads["q"], want_grads["q"]) < tol, f"dq: {err_ratio(grads['q'], want_grads['q']):.2e}"


def test_kernel_gradients_are_those_of_a_constant_normaliser():
    """The cause of the dq above: the kernel's gradients are the float64 layer's with max(|n . q^|, exp(-m)) detached
    (all five within TF32 rounding), and not the layer's own (dq and dk far off)."""
    from lm.bench.mlstm_kernels_grad import compare

    rows = {row["reference"]: row for row in compare(T=64, heads=4, K=64, V=64)["rows"]}
    constant, exact = rows["float64 layer, constant normaliser"], rows["float64 layer"]
    assert all(error < 2e-2 for error in constant.values() if isinstance(error, float)), constant
    assert exact["dq"] > 0.1 and exact["dk"] > 0.1 and exact["dv"] < 2e-2, exact


def test_auto_dispatch():
    x, _ = make_inputs(128, torch.bfloat16)
    args = (x["q"], x["k"], x["v"], None, 64)
    assert not _use_mlstm_kernels("auto", *args)  # the kernel runs only by name (see above)
    assert _use_mlstm_kernels("mlstm_kernels", *args)
    odd, _ = make_inputs(100, torch.bfloat16)
    out, _ = mlstm(*odd.values(), backend="auto")
    assert out.shape == (B, 100, H, V) and torch.isfinite(out.float()).all()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        mlstm(*odd.values(), backend="mlstm_kernels")

"""lm.ops.mlstm's optional mlstm_kernels backend (Triton, "chunkwise--triton_xl_chunk") against the torch code on a
GPU. Skipped on machines without CUDA or without mlstm_kernels (and Triton)."""

import pytest
import torch

from lm.ops.mlstm import _mlstm_kernels_chunkwise_fn, _use_mlstm_kernels, mlstm


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if _mlstm_kernels_chunkwise_fn() is None:
        return "needs mlstm_kernels (with Triton)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")

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


def relative_close(a, b, tol):
    a, b = a.detach().float(), b.detach().float()
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 5e-2), (torch.float32, 2e-2)])  # kernel fp32 dots may be TF32
@pytest.mark.parametrize("T, with_state", [(64, False), (256, False), (256, True)])
def test_kernel_matches_torch(dtype, tol, T, with_state):
    x, state = make_inputs(T, dtype, with_state=with_state)
    w = torch.randn(B, T, H, V, device="cuda")
    results = {}
    for backend in ("mlstm_kernels", "torch"):
        out, final = mlstm(*x.values(), initial_state=state, chunk_size=64, backend=backend)
        grads = torch.autograd.grad((out.float() * w).sum(), list(x.values()))
        results[backend] = out, final, grads
    (out, final, grads), (want, want_final, want_grads) = results["mlstm_kernels"], results["torch"]
    assert out.dtype == dtype and all(s.dtype == torch.float32 for s in final)
    assert [tuple(s.shape) for s in final] == [(B, H, K, V), (B, H, K), (B, H)]
    relative_close(out, want, tol)
    # The stabiliser m follows the same recursion in both, so the stabilised states compare directly.
    for got, ref in zip(final, want_final):
        relative_close(got, ref, tol)
    for name, got, ref in zip(x, grads, want_grads):
        assert torch.isfinite(got).all(), name
        relative_close(got, ref, 2 * tol)


def test_auto_dispatch():
    x, _ = make_inputs(128, torch.bfloat16)
    args = (x["q"], x["k"], x["v"], None, 64)
    assert _use_mlstm_kernels("auto", *args)
    x32, _ = make_inputs(128, torch.float32)
    assert not _use_mlstm_kernels("auto", x32["q"], x32["k"], x32["v"], None, 64)  # float32 stays exact
    odd, _ = make_inputs(100, torch.bfloat16)  # T not a multiple of 16: torch
    out, _ = mlstm(*odd.values(), backend="auto")
    assert out.shape == (B, 100, H, V) and torch.isfinite(out.float()).all()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        mlstm(*odd.values(), backend="mlstm_kernels")

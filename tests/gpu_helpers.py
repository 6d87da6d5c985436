"""What the GPU-only tests share: skip without CUDA, fail on a GPU machine whose kernel packages are missing (so that
bench/gpu.sh cannot look green by skipping), fla's measure of error for half-precision kernels, and the kernels
unchecked: these tests hold the kernels themselves to the bounds (lm.ops.self_check.BOUNDS), so the self-check, which
would put the torch code in place of a kernel that disagrees, is off in them (`raw_kernels`)."""

import importlib

import pytest
import torch


def require_gpu(*packages: str) -> None:
    """Skip the calling test module without CUDA. With CUDA, import each package: a missing or broken one is an
    error when pytest collects the module, not a skip."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    for name in packages:
        importlib.import_module(name)


@pytest.fixture(autouse=True)
def raw_kernels(monkeypatch):
    """The self-check off (LM_KERNEL_SELF_CHECK=0) in every test of a module that imports this fixture: a named kernel
    then runs as asked, so a wrong one fails the test instead of being replaced by the torch code. A test of the
    self-check itself sets it back to 1."""
    monkeypatch.setenv("LM_KERNEL_SELF_CHECK", "0")


def err_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against b, the measure fla's own tests use for half-precision kernels."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).pow(2).mean().sqrt() / (b.pow(2).mean().sqrt() + 1e-12)).item()

"""lm.ops.kernel_packages: a kernel package that is not installed is "not available"; one that is installed but breaks
is an error on a machine with CUDA (where falling back to the torch code would hide it), and "not available" without."""

import pytest
import torch

from lm.ops.kernel_packages import import_kernels


def missing():
    import a_kernel_package_that_is_not_installed  # noqa: F401


def broken():
    raise RuntimeError("Triton: driver error at import")


def test_a_missing_package_is_none_anywhere(monkeypatch):
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert import_kernels(missing) is None
    assert import_kernels(lambda: "kernel") == "kernel"


def test_a_broken_package_raises_only_where_cuda_is(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert import_kernels(broken) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="driver error"):
        import_kernels(broken)

"""lm.ops.fla's reading of fla's own rule for its gated chunk backward (fla issue #640): on Hopper with Triton >= 3.4
and < 3.7.1, fla raises in chunk_bwd_dqkwg unless its TileLang backend takes the backward; TileLang takes it only
where it is usable (installed, with an nvcc) and enabled, and never for simple_gla (Mamba2), whose float32 states it
declines. fla needs Triton and a GPU, so its two flag modules are stood in for with the values fla computes."""

import sys
import types

import pytest

from lm.ops import fla as fla_glue


def fla_flags(monkeypatch, hopper: bool, triton: str, tilelang_usable: bool | None, tilelang_enabled: bool = True):
    """fla.utils' flags for a Triton version and GPU; tilelang_usable None: an fla without the TileLang backend."""
    major_minor = tuple(int(x) for x in triton.split("."))
    utils = types.SimpleNamespace(IS_NVIDIA_HOPPER=hopper, TRITON_ABOVE_3_4_0=major_minor >= (3, 4, 0),
                                  TRITON_ABOVE_3_7_1=major_minor >= (3, 7, 1))
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.utils", utils)
    if tilelang_usable is None:
        monkeypatch.setitem(sys.modules, "fla.ops.common.backends.tilelang", None)  # import fails
    else:
        backend = types.SimpleNamespace(is_available=lambda: tilelang_usable, is_enabled=lambda: tilelang_enabled)
        monkeypatch.setitem(sys.modules, "fla.ops.common.backends.tilelang",
                            types.SimpleNamespace(TileLangBackend=backend))
    fla_glue._tilelang_takes_gated_backward.cache_clear()


@pytest.mark.parametrize("hopper, triton, tilelang_usable, tilelang_enabled, refused", [
    (True, "3.6.0", None, True, {"simple_gla", "gated_delta_rule"}),  # the lent H200
    (True, "3.6.0", False, True, {"simple_gla", "gated_delta_rule"}),  # tilelang imports, no usable nvcc
    (True, "3.6.0", True, False, {"simple_gla", "gated_delta_rule"}),  # FLA_TILELANG=0
    (True, "3.6.0", True, True, {"simple_gla"}),  # TileLang takes the delta rule, never simple_gla
    (True, "3.7.1", None, True, set()),
    (True, "3.3.1", None, True, set()),
    (False, "3.6.0", None, True, set()),  # not Hopper
])
def test_refused_exactly_where_fla_raises(monkeypatch, hopper, triton, tilelang_usable, tilelang_enabled, refused):
    fla_flags(monkeypatch, hopper, triton, tilelang_usable, tilelang_enabled)
    try:
        for kernel in ("simple_gla", "gated_delta_rule"):
            assert fla_glue.fla_refuses_gated_backward(kernel) == (kernel in refused), kernel
    finally:
        fla_glue._tilelang_takes_gated_backward.cache_clear()

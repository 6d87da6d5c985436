"""A slow fallback is never silent: where "auto" runs an op's torch code on CUDA instead of a kernel, it says so once,
with the reason and the fix. CUDA is not here, so the decisions are called with what they would see there."""

import pytest
import torch

from lm.ops import fla as fla_glue
from lm.ops.common import warn_once
from lm.ops.mlstm import say_torch_code_on_cuda


@pytest.fixture(autouse=True)
def fresh_notices():
    warn_once.cache_clear()
    yield
    warn_once.cache_clear()


def test_fla_missing(monkeypatch):
    monkeypatch.setattr(fla_glue, "fla_available", lambda: False)
    with pytest.warns(UserWarning, match=r"delta_rule: the torch code runs on CUDA.*does not import.*\.\[gpu\]"):
        assert not fla_glue.auto_uses_fla("delta_rule", torch.bfloat16)


def test_float32_inputs(monkeypatch):
    monkeypatch.setattr(fla_glue, "fla_available", lambda: True)
    with pytest.warns(UserWarning, match="float32 and fla's kernels take bf16/fp16; train with bf16-mixed"):
        assert not fla_glue.auto_uses_fla("linear_attention", torch.float32)


def test_refused_gated_backward(monkeypatch):
    monkeypatch.setattr(fla_glue, "fla_available", lambda: True)
    monkeypatch.setattr(fla_glue, "fla_refuses_gated_backward", lambda kernel: True)
    with pytest.warns(UserWarning, match=r"chunk_gated_delta_rule.*#640.*Triton >= 3\.7\.1"):
        assert not fla_glue.auto_uses_fla("delta_rule", torch.bfloat16, gated_kernel="gated_delta_rule")
    with torch.no_grad():  # no backward, no refusal: the forward runs fla's kernel
        assert fla_glue.auto_uses_fla("delta_rule", torch.bfloat16, gated_kernel="gated_delta_rule")


def test_the_fast_path_is_quiet_and_a_notice_comes_once(monkeypatch, recwarn):
    monkeypatch.setattr(fla_glue, "fla_available", lambda: True)
    monkeypatch.setattr(fla_glue, "fla_refuses_gated_backward", lambda kernel: False)
    assert fla_glue.auto_uses_fla("delta_rule", torch.bfloat16, gated_kernel="gated_delta_rule")
    assert not recwarn.list
    for _ in range(3):
        fla_glue.auto_uses_fla("linear_attention", torch.float32)
    assert len(recwarn.list) == 1


def test_mlstm_says_why(monkeypatch):
    with pytest.warns(UserWarning, match="mlstm: the torch code runs on CUDA.*normaliser as a constant"):
        say_torch_code_on_cuda()


"""Under autocast (Lightning's bf16-mixed) every op keeps its state and decay arithmetic in float32: called with
float32 inputs inside `torch.autocast`, it returns what it returns outside. (Mesa on ill-conditioned inputs, and
a model under autocast: tests/test_op_mesa.py.)"""

import pytest
import torch

from bench.mixer_speed import OPS, bench_mixer_names, op_inputs


def flat(result):
    """The tensors of an op's (out, state) result, state tuples flattened."""
    out, state = result
    return [out, *(state if isinstance(state, tuple) else (state,))]


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
@pytest.mark.parametrize("mixer", bench_mixer_names())
def test_op_ignores_autocast(mixer, form):
    op, args, _ = op_inputs(mixer, 70, 64, 2, 16, 1)
    fn = OPS[op][0 if form == "chunkwise" else 1]
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    plain = flat(fn(*args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = flat(fn(*args))
    for a, p in zip(autocast, plain):
        assert a.dtype == p.dtype == torch.float32
        torch.testing.assert_close(a, p, rtol=1e-6, atol=1e-6)

"""lm.ops.delta_rule: chunkwise and recurrent forms against a per-token reference of the (gated) delta rule
S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale * S_t^T q_t."""

import pytest
import torch
from op_checks import (
    Op,
    assert_close,
    check_backends,
    check_bfloat16,
    check_forms_agree,
    check_gradients,
    check_reference,
    check_split,
    check_strong_decay,
    check_zero_state_is_default,
    fake_module,
)

from lm.ops.delta_rule import delta_rule, delta_rule_recurrent

B, H, K, V = 2, 3, 5, 7
SCALE = 0.7


def reference(q, k, v, beta, log_alpha, scale, initial_state):
    """The recurrence written out token by token with the explicit matrix I - beta k k^T."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    state = initial_state
    outs = []
    for t in range(q.shape[1]):
        alpha = 1.0 if log_alpha is None else torch.exp(log_alpha[:, t])[:, :, None, None]  # [B, H, 1, 1]
        b = beta[:, t, :, None, None]
        kk = k[:, t, :, :, None] * k[:, t, :, None, :]  # k_t k_t^T: [B, H, K, K]
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]  # k_t v_t^T: [B, H, K, V]
        state = alpha * ((eye - b * kk) @ state) + b * kv
        outs.append(scale * (state * q[:, t, :, :, None]).sum(-2))  # S_t^T q_t
    return torch.stack(outs, dim=1), state


def make_inputs(T, dtype=torch.float64, seed=0, requires_grad=False, gated=True):
    """Realistic inputs: L2-normalised keys, beta in (0, 1), log-decay in [-2, 0], a random initial state."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)
    x = dict(
        q=rand(B, T, H, K),
        k=torch.nn.functional.normalize(rand(B, T, H, K), dim=-1),
        v=rand(B, T, H, V),
        beta=torch.rand(B, T, H, generator=g, dtype=dtype),
        log_alpha=-2 * torch.rand(B, T, H, generator=g, dtype=dtype),
        initial_state=rand(B, H, K, V),
    )
    if not gated:
        del x["log_alpha"]
    return {name: t.requires_grad_(requires_grad) for name, t in x.items()}


def chunkwise(x, chunk_size=16, **kw):
    return delta_rule(
        x["q"],
        x["k"],
        x["v"],
        x["beta"],
        x.get("log_alpha"),
        SCALE,
        initial_state=x["initial_state"],
        chunk_size=chunk_size,
        backend="torch",
        **kw,
    )


def recurrent(x):
    return delta_rule_recurrent(
        x["q"], x["k"], x["v"], x["beta"], x.get("log_alpha"), SCALE, initial_state=x["initial_state"]
    )


def ref(x):
    return reference(x["q"], x["k"], x["v"], x["beta"], x.get("log_alpha"), SCALE, x["initial_state"])


OP = Op(chunkwise, recurrent, ref)
GATED = pytest.mark.parametrize("gated", [True, False], ids=["gated", "deltanet"])


@GATED
@pytest.mark.parametrize("T,chunk_size", [(1, 16), (17, 16), (64, 16), (65, 16), (200, 16), (200, 64)])
def test_chunkwise_matches_reference_float64(T, chunk_size, gated):
    check_reference(OP, lambda x: chunkwise(x, chunk_size), make_inputs(T, gated=gated), 1e-10,
                    shapes=((B, T, H, V), [(B, H, K, V)]))


@GATED
@pytest.mark.parametrize("T", [1, 17, 65])
def test_recurrent_matches_reference_float64(T, gated):
    check_reference(OP, recurrent, make_inputs(T, gated=gated), 1e-10)


@GATED
@pytest.mark.parametrize("T,chunk_size", [(17, 16), (200, 64)])
def test_chunkwise_matches_recurrent_float32(T, chunk_size, gated):
    check_forms_agree(OP, make_inputs(T, torch.float32, gated=gated), chunk_size, 1e-5)


def test_log_alpha_none_means_no_decay():
    x = make_inputs(33)
    x_none = make_inputs(33, gated=False)
    x_zero = dict(x_none, log_alpha=torch.zeros_like(x["log_alpha"]))
    assert_close(chunkwise(x_none)[0], chunkwise(x_zero)[0], 1e-12)
    assert_close(recurrent(x_none)[1], recurrent(x_zero)[1], 1e-12)


def test_zero_initial_state_is_default():
    check_zero_state_is_default(OP, make_inputs(20), lambda x: delta_rule(x["q"], x["k"], x["v"], x["beta"],
                                                                          x["log_alpha"], SCALE, chunk_size=16))


@GATED
@pytest.mark.parametrize("T", [17, 65])
def test_gradients_match_reference(T, gated):
    check_gradients(OP, chunkwise, make_inputs(T, requires_grad=True, gated=gated), 1e-8)


@GATED
def test_split_sequence_with_carried_state_equals_one_call(gated):
    # and decoding: one step with the recurrent form, continuing from the chunkwise state
    check_split(OP, make_inputs(100, gated=gated), [37], 1e-10, decode=(37, 38, 1))


def test_strong_decay_long_sequence_stays_finite():
    check_strong_decay(OP, make_inputs(300), "log_alpha")


@GATED
def test_bfloat16_inputs(gated):
    check_bfloat16(OP, make_inputs(70, torch.float32, gated=gated))


def test_backend_checks():
    x = make_inputs(5, torch.float32)
    args = (x["q"], x["k"], x["v"], x["beta"])
    check_backends(lambda **kw: delta_rule(*args, **kw))
    with pytest.raises(ValueError, match="log_alpha"):
        delta_rule(*args, x["log_alpha"][:, :, :1])


@GATED
def test_fla_glue_with_a_fake_fla(monkeypatch, gated):
    """The fla adapter (which entry point, g = log_alpha, explicit scale, initial/final state, head_first=False only
    for old fla versions that default to head-first), run against stand-ins for fla's delta-rule entry points that
    follow fla's documented semantics, since fla needs a GPU."""
    from lm.ops.fla import fla_delta_rule

    calls = []

    def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False, head_first=True):
        assert q.dtype == k.dtype == v.dtype != torch.float32 and not head_first
        calls.append("delta_rule")
        return delta_rule_recurrent(q, k, v, beta, None, scale, initial_state=initial_state)

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
        assert "head_first" not in kw and output_final_state
        calls.append("gated_delta_rule")
        return delta_rule_recurrent(q, k, v, beta, g, scale, initial_state=initial_state)

    fake_module(monkeypatch, "fla.ops.delta_rule", chunk_delta_rule=chunk_delta_rule)
    fake_module(monkeypatch, "fla.ops.gated_delta_rule", chunk_gated_delta_rule=chunk_gated_delta_rule)
    x = make_inputs(20, torch.float32, gated=gated)
    x16 = {n: t.bfloat16() if n != "initial_state" else t for n, t in x.items()}
    args = (x16["q"], x16["k"], x16["v"], x16["beta"], x16.get("log_alpha"), SCALE, x16["initial_state"])
    out, state = fla_delta_rule(*args)
    assert calls == ["gated_delta_rule" if gated else "delta_rule"]
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    out_ref, state_ref = chunkwise(x16)
    assert_close(out.float(), out_ref.float(), 1e-2)
    assert_close(state, state_ref, 1e-4)
    with pytest.raises(TypeError, match="bf16"):
        fla_delta_rule(*(t.float() if isinstance(t, torch.Tensor) else t for t in args))

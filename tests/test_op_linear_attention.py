"""lm.ops.linear_attention: chunkwise and recurrent forms against a per-token reference of the recurrence
S_t = gamma_t S_{t-1} + beta_t k_t v_t^T, o_t = scale * S_t^T q_t."""

import pytest
import torch

from lm.ops.linear_attention import linear_attention, linear_attention_recurrent

B, H, K, V = 2, 3, 5, 7
SCALE = 0.7


def reference(q, k, v, log_gamma, beta, scale, initial_state):
    """The recurrence written out token by token with broadcasting, independently of the op's recurrent form."""
    state = initial_state
    outs = []
    for t in range(q.shape[1]):
        gamma = torch.exp(log_gamma[:, t])[:, :, None, None]  # [B, H, 1, 1]
        outer = k[:, t, :, :, None] * v[:, t, :, None, :]  # k_t v_t^T: [B, H, K, V]
        state = gamma * state + beta[:, t, :, None, None] * outer
        outs.append(scale * (state * q[:, t, :, :, None]).sum(-2))  # S_t^T q_t
    return torch.stack(outs, dim=1), state


def make_inputs(T, dtype=torch.float64, seed=0, requires_grad=False):
    """Realistic inputs: beta in (0, 1), log-decay in [-2, 0], a random initial state."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)
    x = dict(
        q=rand(B, T, H, K),
        k=rand(B, T, H, K),
        v=rand(B, T, H, V),
        log_gamma=-2 * torch.rand(B, T, H, generator=g, dtype=dtype),
        beta=torch.rand(B, T, H, generator=g, dtype=dtype),
        initial_state=rand(B, H, K, V),
    )
    return {name: t.requires_grad_(requires_grad) for name, t in x.items()}


def chunkwise(x, chunk_size=16, **kw):
    return linear_attention(
        x["q"],
        x["k"],
        x["v"],
        x["log_gamma"],
        x["beta"],
        SCALE,
        initial_state=x["initial_state"],
        chunk_size=chunk_size,
        backend="torch",
        **kw,
    )


def recurrent(x):
    return linear_attention_recurrent(
        x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], SCALE, initial_state=x["initial_state"]
    )


def ref(x):
    return reference(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], SCALE, x["initial_state"])


def assert_close(a, b, tol):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("T,chunk_size", [(1, 16), (17, 16), (64, 16), (65, 16), (200, 16), (200, 64)])
def test_chunkwise_matches_reference_float64(T, chunk_size):
    x = make_inputs(T)
    out, state = chunkwise(x, chunk_size)
    out_ref, state_ref = ref(x)
    assert out.shape == (B, T, H, V) and state.shape == (B, H, K, V)
    assert out.dtype == state.dtype == torch.float64
    assert_close(out, out_ref, 1e-10)
    assert_close(state, state_ref, 1e-10)


@pytest.mark.parametrize("T", [1, 17, 65])
def test_recurrent_matches_reference_float64(T):
    x = make_inputs(T)
    out, state = recurrent(x)
    out_ref, state_ref = ref(x)
    assert_close(out, out_ref, 1e-10)
    assert_close(state, state_ref, 1e-10)


@pytest.mark.parametrize("T,chunk_size", [(17, 16), (200, 64)])
def test_chunkwise_matches_recurrent_float32(T, chunk_size):
    x = make_inputs(T, torch.float32)
    out, state = chunkwise(x, chunk_size)
    out_rec, state_rec = recurrent(x)
    assert out.dtype == state.dtype == torch.float32
    assert_close(out, out_rec, 1e-5)
    assert_close(state, state_rec, 1e-5)


def test_beta_none_means_one():
    x = make_inputs(33)
    x_none = dict(x, beta=None)
    x_ones = dict(x, beta=torch.ones_like(x["beta"]))
    assert_close(chunkwise(x_none)[0], chunkwise(x_ones)[0], 1e-12)
    assert_close(recurrent(x_none)[1], recurrent(x_ones)[1], 1e-12)


def test_zero_initial_state_is_default():
    x = make_inputs(20)
    x["initial_state"] = torch.zeros_like(x["initial_state"])
    out, state = linear_attention(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], SCALE, chunk_size=16)
    assert_close(out, chunkwise(x)[0], 1e-12)
    assert_close(state, chunkwise(x)[1], 1e-12)


@pytest.mark.parametrize("T", [17, 65])
def test_gradients_match_reference(T):
    x = make_inputs(T, requires_grad=True)
    g = torch.Generator().manual_seed(1)
    w_out = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    w_state = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    loss = lambda res: (res[0] * w_out).sum() + (res[1] * w_state).sum()
    inputs = list(x.values())
    grads = torch.autograd.grad(loss(chunkwise(x)), inputs)
    grads_ref = torch.autograd.grad(loss(ref(x)), inputs)
    for name, a, b in zip(x, grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8, msg=f"gradient w.r.t. {name}")


def test_split_sequence_with_carried_state_equals_one_call():
    x = make_inputs(100)
    out, state = chunkwise(x)
    first = {n: t[:, :37] for n, t in x.items() if n != "initial_state"}
    first["initial_state"] = x["initial_state"]
    out1, state1 = chunkwise(first)
    second = {n: t[:, 37:] for n, t in x.items() if n != "initial_state"}
    second["initial_state"] = state1
    out2, state2 = chunkwise(second)
    assert_close(torch.cat([out1, out2], dim=1), out, 1e-10)
    assert_close(state2, state, 1e-10)
    # decoding: one step at a time with the recurrent form, continuing from the chunkwise state
    step = {n: t[:, 37:38] for n, t in x.items() if n != "initial_state"}
    out_step, _ = linear_attention_recurrent(
        step["q"], step["k"], step["v"], step["log_gamma"], step["beta"], SCALE, initial_state=state1
    )
    assert_close(out_step, out[:, 37:38], 1e-10)


def test_strong_decay_long_sequence_stays_finite():
    x = make_inputs(300)
    log_gamma = x["log_gamma"].clone()
    log_gamma[:, 10:200:7] = -20.0  # decays of e^-20 per step: cumulative sums reach far below float range
    log_gamma[:, 250:] = -20.0
    x["log_gamma"] = log_gamma
    out, state = chunkwise(x, chunk_size=64)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    out_ref, state_ref = ref(x)
    assert_close(out, out_ref, 1e-10)
    assert_close(state, state_ref, 1e-10)
    # float32 too, including its gradients (an inf above the diagonal would turn into NaN in the backward pass)
    x32 = {n: t.float().requires_grad_() for n, t in x.items()}
    out32, state32 = chunkwise(x32, chunk_size=64)
    assert_close(out32.double(), out_ref, 1e-4)
    (out32.sum() + state32.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in x32.values())


def test_bfloat16_inputs():
    x = make_inputs(70, torch.float32)
    out32, state32 = chunkwise(x)
    x16 = {n: t.bfloat16() if n != "initial_state" else t for n, t in x.items()}
    out, state = chunkwise(x16)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    rec_out, rec_state = recurrent(x16)
    assert rec_out.dtype == torch.bfloat16 and rec_state.dtype == torch.float32
    for a, b in ((out, out32), (rec_out, out32), (state, state32), (rec_state, state32)):
        err = (a.float() - b).norm() / b.norm()
        assert err < 2e-2, err


def test_backend_checks():
    x = make_inputs(5, torch.float32)
    args = (x["q"], x["k"], x["v"], x["log_gamma"])
    with pytest.raises(ValueError, match="backend"):
        linear_attention(*args, backend="cuda")
    with pytest.raises(RuntimeError, match="CUDA"):
        linear_attention(*args, backend="fla")
    # "auto" on CPU is the torch code
    torch.testing.assert_close(linear_attention(*args)[0], linear_attention(*args, backend="torch")[0])
    with pytest.raises(ValueError, match="log_gamma"):
        linear_attention(x["q"], x["k"], x["v"], x["log_gamma"][:, :, :1])


def test_fla_glue_with_a_fake_fla(monkeypatch):
    """The fla adapter (beta folded into k, explicit scale, initial/final state, no head_first for fla >= 0.6), run
    against a stand-in for fla.ops.simple_gla that follows fla's documented semantics, since fla needs a GPU."""
    import sys
    import types

    from lm.ops.fla import fla_linear_attention

    calls = []

    def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, **kw):
        assert "head_first" not in kw and g_gamma is None
        calls.append(scale)
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        out, state = linear_attention_recurrent(q, k, v, g, None, scale, initial_state=initial_state)
        return out, state if output_final_state else None

    fake = types.ModuleType("fla.ops.simple_gla")
    fake.chunk_simple_gla = chunk_simple_gla
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", fake)
    x = make_inputs(20, torch.float32)
    out, state = fla_linear_attention(
        x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], SCALE, initial_state=x["initial_state"]
    )
    assert calls == [SCALE]
    out_ref, state_ref = chunkwise(x)
    assert_close(out, out_ref, 1e-5)
    assert_close(state, state_ref, 1e-5)

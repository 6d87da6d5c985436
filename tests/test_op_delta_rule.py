"""lm.ops.delta_rule: chunkwise and recurrent forms against a per-token reference of the (gated) delta rule
S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale * S_t^T q_t."""

import pytest
import torch

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


def assert_close(a, b, tol):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


GATED = pytest.mark.parametrize("gated", [True, False], ids=["gated", "deltanet"])


@GATED
@pytest.mark.parametrize("T,chunk_size", [(1, 16), (17, 16), (64, 16), (65, 16), (200, 16), (200, 64)])
def test_chunkwise_matches_reference_float64(T, chunk_size, gated):
    x = make_inputs(T, gated=gated)
    out, state = chunkwise(x, chunk_size)
    out_ref, state_ref = ref(x)
    assert out.shape == (B, T, H, V) and state.shape == (B, H, K, V)
    assert out.dtype == state.dtype == torch.float64
    assert_close(out, out_ref, 1e-10)
    assert_close(state, state_ref, 1e-10)


@GATED
@pytest.mark.parametrize("T", [1, 17, 65])
def test_recurrent_matches_reference_float64(T, gated):
    x = make_inputs(T, gated=gated)
    out, state = recurrent(x)
    out_ref, state_ref = ref(x)
    assert_close(out, out_ref, 1e-10)
    assert_close(state, state_ref, 1e-10)


@GATED
@pytest.mark.parametrize("T,chunk_size", [(17, 16), (200, 64)])
def test_chunkwise_matches_recurrent_float32(T, chunk_size, gated):
    x = make_inputs(T, torch.float32, gated=gated)
    out, state = chunkwise(x, chunk_size)
    out_rec, state_rec = recurrent(x)
    assert out.dtype == state.dtype == torch.float32
    assert_close(out, out_rec, 1e-5)
    assert_close(state, state_rec, 1e-5)


def test_log_alpha_none_means_no_decay():
    x = make_inputs(33)
    x_none = make_inputs(33, gated=False)
    x_zero = dict(x_none, log_alpha=torch.zeros_like(x["log_alpha"]))
    assert_close(chunkwise(x_none)[0], chunkwise(x_zero)[0], 1e-12)
    assert_close(recurrent(x_none)[1], recurrent(x_zero)[1], 1e-12)


def test_zero_initial_state_is_default():
    x = make_inputs(20)
    x["initial_state"] = torch.zeros_like(x["initial_state"])
    out, state = delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_alpha"], SCALE, chunk_size=16)
    assert_close(out, chunkwise(x)[0], 1e-12)
    assert_close(state, chunkwise(x)[1], 1e-12)


@GATED
@pytest.mark.parametrize("T", [17, 65])
def test_gradients_match_reference(T, gated):
    x = make_inputs(T, requires_grad=True, gated=gated)
    g = torch.Generator().manual_seed(1)
    w_out = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    w_state = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    loss = lambda res: (res[0] * w_out).sum() + (res[1] * w_state).sum()
    inputs = list(x.values())
    grads = torch.autograd.grad(loss(chunkwise(x)), inputs)
    grads_ref = torch.autograd.grad(loss(ref(x)), inputs)
    for name, a, b in zip(x, grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8, msg=f"gradient w.r.t. {name}")


@GATED
def test_split_sequence_with_carried_state_equals_one_call(gated):
    x = make_inputs(100, gated=gated)
    out, state = chunkwise(x)
    first = {n: t[:, :37] for n, t in x.items() if n != "initial_state"}
    first["initial_state"] = x["initial_state"]
    out1, state1 = chunkwise(first)
    second = {n: t[:, 37:] for n, t in x.items() if n != "initial_state"}
    second["initial_state"] = state1
    out2, state2 = chunkwise(second)
    assert_close(torch.cat([out1, out2], dim=1), out, 1e-10)
    assert_close(state2, state, 1e-10)
    # decoding: one step with the recurrent form, continuing from the chunkwise state
    step = {n: t[:, 37:38] for n, t in x.items() if n != "initial_state"}
    step["initial_state"] = state1
    assert_close(recurrent(step)[0], out[:, 37:38], 1e-10)


def test_strong_decay_long_sequence_stays_finite():
    x = make_inputs(300)
    log_alpha = x["log_alpha"].clone()
    log_alpha[:, 10:200:7] = -20.0  # decays of e^-20 per step: cumulative sums reach far below float range
    log_alpha[:, 250:] = -20.0
    x["log_alpha"] = log_alpha
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


@GATED
def test_bfloat16_inputs(gated):
    x = make_inputs(70, torch.float32, gated=gated)
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
    args = (x["q"], x["k"], x["v"], x["beta"])
    with pytest.raises(ValueError, match="backend"):
        delta_rule(*args, backend="cuda")
    with pytest.raises(RuntimeError, match="CUDA"):
        delta_rule(*args, backend="fla")
    # "auto" on CPU is the torch code
    torch.testing.assert_close(delta_rule(*args)[0], delta_rule(*args, backend="torch")[0])
    with pytest.raises(ValueError, match="log_alpha"):
        delta_rule(*args, x["log_alpha"][:, :, :1])


@GATED
def test_fla_glue_with_a_fake_fla(monkeypatch, gated):
    """The fla adapter (which entry point, g = log_alpha, explicit scale, initial/final state, head_first=False only
    for old fla versions that default to head-first), run against stand-ins for fla's delta-rule entry points that
    follow fla's documented semantics, since fla needs a GPU."""
    import sys
    import types

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

    for name, fn in (("delta_rule", chunk_delta_rule), ("gated_delta_rule", chunk_gated_delta_rule)):
        fake = types.ModuleType(f"fla.ops.{name}")
        setattr(fake, f"chunk_{name}", fn)
        monkeypatch.setitem(sys.modules, f"fla.ops.{name}", fake)
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

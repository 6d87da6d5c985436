"""lm.ops.linear_attention: chunkwise and recurrent forms against a per-token reference of the recurrence
S_t = gamma_t S_{t-1} + beta_t k_t v_t^T, o_t = scale * S_t^T q_t, with gamma a scalar per head or (GLA) a vector
per key dimension, S_t = diag(gamma_t) S_{t-1} + beta_t k_t v_t^T."""

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
from torch.utils.flop_counter import FlopCounterMode

from lm.ops import flops as op_flops
from lm.ops.linear_attention import linear_attention, linear_attention_recurrent

B, H, K, V = 2, 3, 5, 7
SCALE = 0.7


def reference(q, k, v, log_gamma, beta, scale, initial_state):
    """The recurrence written out token by token with broadcasting, independently of the op's recurrent form."""
    state = initial_state
    outs = []
    for t in range(q.shape[1]):
        gamma = torch.exp(log_gamma[:, t])  # [B, H], or [B, H, K] per key dimension
        gamma = gamma[..., None] if gamma.dim() == 3 else gamma[..., None, None]  # scales the state's rows
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


def make_per_key_inputs(T, dtype=torch.float64, seed=0, requires_grad=False):
    """As make_inputs with log_gamma [B, T, H, K]: per-step log-decays log-uniform in [-8, -1e-4], so one head mixes
    dimensions that forget within a step with ones that barely decay."""
    x = make_inputs(T, dtype, seed)
    g = torch.Generator().manual_seed(seed + 100)
    log_rate = torch.empty(B, T, H, K, dtype=dtype).uniform_(-4 * 2.3026, 2.0794, generator=g)  # ln 1e-4 .. ln 8
    x["log_gamma"] = -log_rate.exp()
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


OP = Op(chunkwise, recurrent, ref)


@pytest.mark.parametrize("T,chunk_size", [(1, 16), (17, 16), (64, 16), (65, 16), (200, 16), (200, 64)])
def test_chunkwise_matches_reference_float64(T, chunk_size):
    check_reference(OP, lambda x: chunkwise(x, chunk_size), make_inputs(T), 1e-10,
                    shapes=((B, T, H, V), [(B, H, K, V)]))


@pytest.mark.parametrize("T", [1, 17, 65])
def test_recurrent_matches_reference_float64(T):
    check_reference(OP, recurrent, make_inputs(T), 1e-10)


@pytest.mark.parametrize("T,chunk_size", [(17, 16), (200, 64)])
def test_chunkwise_matches_recurrent_float32(T, chunk_size):
    check_forms_agree(OP, make_inputs(T, torch.float32), chunk_size, 1e-5)


def test_beta_none_means_one():
    x = make_inputs(33)
    x_none = dict(x, beta=None)
    x_ones = dict(x, beta=torch.ones_like(x["beta"]))
    assert_close(chunkwise(x_none)[0], chunkwise(x_ones)[0], 1e-12)
    assert_close(recurrent(x_none)[1], recurrent(x_ones)[1], 1e-12)


def test_zero_initial_state_is_default():
    check_zero_state_is_default(OP, make_inputs(20), lambda x: linear_attention(
        x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], SCALE, chunk_size=16))


@pytest.mark.parametrize("T", [17, 65])
def test_gradients_match_reference(T):
    check_gradients(OP, chunkwise, make_inputs(T, requires_grad=True), 1e-8)


def test_split_sequence_with_carried_state_equals_one_call():
    # and decoding: one step with the recurrent form, continuing from the chunkwise state
    check_split(OP, make_inputs(100), [37], 1e-10, decode=(37, 38, 1))


def test_strong_decay_long_sequence_stays_finite():
    check_strong_decay(OP, make_inputs(300), "log_gamma")


def test_bfloat16_inputs():
    check_bfloat16(OP, make_inputs(70, torch.float32))


def test_backend_checks():
    x = make_inputs(5, torch.float32)
    args = (x["q"], x["k"], x["v"], x["log_gamma"])
    check_backends(lambda **kw: linear_attention(*args, **kw))
    with pytest.raises(ValueError, match="log_gamma"):
        linear_attention(x["q"], x["k"], x["v"], x["log_gamma"][:, :, :1])


def test_fla_glue_with_a_fake_fla(monkeypatch):
    """The fla adapter (beta folded into k, explicit scale, initial/final state, no head_first for fla >= 0.6), run
    against a stand-in for fla.ops.simple_gla that follows fla's documented semantics, since fla needs a GPU."""
    from lm.ops.fla import fla_linear_attention

    calls = []

    def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, **kw):
        assert "head_first" not in kw and g_gamma is None
        calls.append(scale)
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        out, state = linear_attention_recurrent(q, k, v, g, None, scale, initial_state=initial_state)
        return out, state if output_final_state else None

    fake_module(monkeypatch, "fla.ops.simple_gla", chunk_simple_gla=chunk_simple_gla)
    x = make_inputs(20, torch.float32)
    out, state = fla_linear_attention(
        x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], SCALE, initial_state=x["initial_state"]
    )
    assert calls == [SCALE]
    out_ref, state_ref = chunkwise(x)
    assert_close(out, out_ref, 1e-5)
    assert_close(state, state_ref, 1e-5)


# --- per-key decay (GLA) ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T,chunk_size,sub_chunk",
    [(1, 16, 4), (17, 16, 4), (64, 16, 4), (65, 16, 4), (200, 16, 4), (200, 64, 16), (50, 24, 16)],
)
def test_per_key_chunkwise_matches_reference_float64(T, chunk_size, sub_chunk):
    check_reference(OP, lambda x: chunkwise(x, chunk_size, sub_chunk=sub_chunk),
                    make_per_key_inputs(T, requires_grad=True), 1e-10, shapes=((B, T, H, V), [(B, H, K, V)]),
                    grad_tol=1e-10)


@pytest.mark.parametrize("T", [1, 17, 65])
def test_per_key_recurrent_matches_reference_float64(T):
    check_reference(OP, recurrent, make_per_key_inputs(T, requires_grad=True), 1e-10, grad_tol=1e-10)


def test_per_key_split_sequence_with_carried_state_equals_one_call():
    # and decoding one step with the recurrent form from the chunkwise state
    check_split(OP, make_per_key_inputs(100), [37], 1e-10, decode=(37, 38, 1), sub_chunk=4)


def test_per_key_chunkwise_matches_recurrent_float32():
    x = make_per_key_inputs(100, torch.float32)
    check_forms_agree(OP, x, 64, 1e-5, sub_chunk=16)
    out, _ = chunkwise(x, 64, sub_chunk=16)
    # Against the exact result: 3.5e-6 at worst (the recurrent form: 1.6e-6). Exponents taken as differences of
    # chunk-level cumulative sums instead of direct sums measured 1.3e-5.
    out_ref, _ = ref({n: t.double() for n, t in x.items()})
    assert (out.double() - out_ref).abs().max() < 6e-6


def test_per_key_float32_long_sequence_mixed_decays():
    """T = 4096 in float32 with per-step log-decays from -1e-4 to -8 across the key dimensions of each head, at the
    default chunk sizes (64, sub-chunks of 8): within a chunk the cumulative log-decay of the fast dimensions reaches
    -512, so any exp(-b) factoring would overflow. Against the float64 chunkwise result (itself checked against the
    reference above), the relative error measured was 2.4e-7 (outputs) and 2.5e-7 (state); gradients stay finite."""
    T, b, h, k, v = 4096, 1, 2, 16, 16
    g = torch.Generator().manual_seed(0)
    q, key = (torch.randn(b, T, h, k, generator=g, dtype=torch.float64) for _ in range(2))
    val = torch.randn(b, T, h, v, generator=g, dtype=torch.float64)
    rate = torch.logspace(-4, 0.903, k, dtype=torch.float64)  # 1e-4 .. 8 along the key dimension of every head
    log_gamma = -(rate * torch.empty(b, T, h, k, dtype=torch.float64).uniform_(0.5, 1.5, generator=g)).clamp(1e-4, 8)
    beta = torch.rand(b, T, h, generator=g, dtype=torch.float64)
    s0 = torch.randn(b, h, k, v, generator=g, dtype=torch.float64)
    inputs = (q, key, val, log_gamma, beta, s0)
    out64, state64 = linear_attention(*inputs[:5], 0.25, initial_state=s0, backend="torch")
    x32 = [t.float().requires_grad_() for t in inputs]
    out32, state32 = linear_attention(*x32[:5], 0.25, initial_state=x32[5], backend="torch")
    assert torch.isfinite(out32).all() and torch.isfinite(state32).all()
    rel = lambda a, ref: ((a.double() - ref).norm() / ref.norm()).item()
    assert rel(out32, out64) < 2e-6 and rel(state32, state64) < 2e-6, (rel(out32, out64), rel(state32, state64))
    (out32.square().mean() + state32.square().mean()).backward()
    assert all(torch.isfinite(t.grad).all() for t in x32)


def test_per_key_shapes():
    x = make_per_key_inputs(5, torch.float32)
    with pytest.raises(ValueError, match="log_gamma"):
        linear_attention(x["q"], x["k"], x["v"], x["log_gamma"][..., :-1])
    with pytest.raises(ValueError, match="log_gamma"):
        linear_attention_recurrent(x["q"], x["k"], x["v"], x["log_gamma"][..., :-1])
    # a per-key decay that is the same in every dimension is the scalar decay
    scalar = make_inputs(40)
    per_key = dict(scalar, log_gamma=scalar["log_gamma"][..., None].expand(B, 40, H, K))
    assert_close(chunkwise(per_key, sub_chunk=4)[0], chunkwise(scalar)[0], 1e-10)


def counted(fn) -> tuple[int, int]:
    """FLOPs FlopCounterMode sees in fn(), and in its backward from a scalar of the output (as tests/test_flops.py)."""
    with FlopCounterMode(display=False) as forward:
        out = fn()
    with FlopCounterMode(display=False) as backward:
        out.square().mean().backward()
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize("T,chunk_size,sub_chunk", [(50, 16, 4), (130, 64, 16), (40, 64, 16)])
def test_gla_flops_match_the_counter(T, chunk_size, sub_chunk):
    x = make_per_key_inputs(T, torch.float32, requires_grad=True)
    forward, backward = counted(lambda: chunkwise(x, chunk_size, sub_chunk=sub_chunk)[0])
    C = -(-min(chunk_size, T) // sub_chunk) * sub_chunk  # the chunk the op uses: a whole number of sub-chunks
    padded = -(-T // C) * C
    assert forward == B * padded * H * op_flops.gla_op_flops(C, K, V, sub_chunk)
    assert forward + backward == B * padded * H * op_flops.gla_op_train_flops(C, K, V, sub_chunk, padded // C,
                                                                               learned_initial_state=True)


def test_fla_gla_glue_with_a_fake_fla(monkeypatch):
    """The per-key fla adapter (beta folded into k, explicit scale, initial/final state) against a stand-in for
    fla.ops.gla.chunk_gla following fla's documented semantics (g: [B, T, H, K] log-decay), since fla needs a GPU."""
    from lm.ops.fla import fla_linear_attention

    calls = []

    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, **kw):
        assert "head_first" not in kw and g.shape == q.shape
        calls.append(scale)
        out, state = linear_attention_recurrent(q, k, v, g, None, scale, initial_state=initial_state)
        return out, state if output_final_state else None

    fake_module(monkeypatch, "fla.ops.gla", chunk_gla=chunk_gla)
    x = make_per_key_inputs(20, torch.float32)
    out, state = fla_linear_attention(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], SCALE,
                                      initial_state=x["initial_state"])
    assert calls == [SCALE]
    out_ref, state_ref = chunkwise(x, sub_chunk=4)
    assert_close(out, out_ref, 1e-5)
    assert_close(state, state_ref, 1e-5)


def test_per_key_ignores_autocast():
    """The op casts to float32 once and turns autocast off inside, so bf16 autocast changes nothing."""
    x = make_per_key_inputs(40, torch.float32)
    out, state = chunkwise(x, sub_chunk=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ac, state_ac = chunkwise(x, sub_chunk=4)
    assert out_ac.dtype == torch.float32
    assert torch.equal(out_ac, out) and torch.equal(state_ac, state)

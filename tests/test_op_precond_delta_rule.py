"""lm.ops.precond_delta_rule: chunkwise and recurrent forms against a per-token reference of the preconditioned gated
delta rule (fla's naive_recurrent_precond_gated_delta_rule on unit q, k): A_t = alpha^A_t A_{t-1} + beta^A_t k_t^2,
M_t = squash^(-s(log(A_t + eps) - center)), s(r) = r / (1 + |r|), S_t = (I - beta_t (M_t k_t) k_t^T) alpha_t S_{t-1}
+ beta_t (M_t k_t) v_t^T, o_t = scale * S_t^T q_t; beta in [0, 2]."""

import sys

import pytest
import torch
import torch.nn.functional as F
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
    fake_module,
)

from lm.ops import delta_rule, precond_delta_rule, precond_delta_rule_recurrent, self_check
from lm.ops.common import warn_once

B, H, K, V = 2, 2, 4, 3
SCALE = 0.7
SQUASH, EPS = 1.5, 1e-6


def reference(x, reset=None, squash=SQUASH):
    """Token by token, with the explicit matrix of the step; a reset zeroes S and A before its step."""
    q, k, v, beta, beta_a = x["q"], x["k"], x["v"], x["beta"], x["beta_a"]
    center = x["center"][:, None] if torch.is_tensor(x["center"]) else x["center"]
    eye = torch.eye(K, dtype=q.dtype)
    S, A, outs = x["S0"], x["A0"], []
    for t in range(q.shape[1]):
        if reset is not None:
            keep = (~reset[:, t]).to(q.dtype)
            S, A = S * keep[:, None, None, None], A * keep[:, None, None]
        A = torch.exp(x["log_alpha_a"][:, t])[..., None] * A + beta_a[:, t, :, None] * k[:, t] ** 2
        r = torch.log(A + EPS) - center
        M = squash ** (-(r / (1 + r.abs())))
        alpha = 1.0 if x.get("log_alpha") is None else torch.exp(x["log_alpha"][:, t])[..., None, None]
        p, b = M * k[:, t], beta[:, t, :, None, None]
        S = (eye - b * p[..., :, None] * k[:, t, :, None, :]) @ (alpha * S) + b * p[..., :, None] * v[:, t, :, None, :]
        outs.append(SCALE * (S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1), (S, A)


def make_inputs(T, dtype=torch.float64, seed=0, requires_grad=False, gated=True, center_per_head=True):
    """Unit q and k; beta in [0, 2], beta_a in [0, 1]; decays near 0.9; a random (S, A) to start from; a center per
    head (or fla's default, a float)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    uniform = lambda *shape: torch.rand(*shape, generator=g, dtype=dtype)  # noqa: E731
    x = dict(q=F.normalize(rand(B, T, H, K), dim=-1), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V),
             beta=2 * uniform(B, T, H), log_alpha=F.logsigmoid(rand(B, T, H) + 2), beta_a=uniform(B, T, H),
             log_alpha_a=F.logsigmoid(rand(B, T, H) + 2), S0=rand(B, H, K, V), A0=uniform(B, H, K),
             center=torch.tensor([-0.2, 0.4], dtype=dtype))
    if not gated:
        del x["log_alpha"]
    x = {name: t.requires_grad_(requires_grad) for name, t in x.items()}
    if not center_per_head:
        x["center"] = -0.2
    return x


def args(x):
    return (x["q"], x["k"], x["v"], x["beta"], x.get("log_alpha"), x["beta_a"], x["log_alpha_a"], SCALE)


def chunkwise(x, chunk_size=8, **kw):
    return precond_delta_rule(*args(x), center=x["center"], initial_state=(x["S0"], x["A0"]), chunk_size=chunk_size,
                              backend="torch", **kw)


def recurrent(x, **kw):
    return precond_delta_rule_recurrent(*args(x), center=x["center"], initial_state=(x["S0"], x["A0"]), **kw)


OP = Op(chunkwise, recurrent, reference, state=("S0", "A0"), static=("center",))
SHAPES = ((B, 13, H, V), [(B, H, K, V), (B, H, K)])


@pytest.mark.parametrize("chunk_size", [8, 16])
@pytest.mark.parametrize("gated,center_per_head", [(True, True), (False, False)], ids=["gated", "ungated"])
def test_chunkwise_matches_reference_float64(chunk_size, gated, center_per_head):
    x = make_inputs(13, gated=gated, center_per_head=center_per_head)
    check_reference(OP, lambda x: chunkwise(x, chunk_size), x, 1e-10, shapes=SHAPES)


def test_recurrent_matches_reference_float64():
    check_reference(OP, recurrent, make_inputs(13), 1e-10, shapes=SHAPES)


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_resets_on_and_inside_a_chunk_match_the_reference_with_gradients(form):
    """Resets at a chunk's first step (8), inside chunks, twice in a row, at a chunk's last step (15) and at step 0 of
    row 1: outputs, both states and every input's gradient (the center's and the initial (S, A)'s included)."""
    reset = torch.zeros(B, 21, dtype=torch.bool)
    reset[0, [3, 8, 12, 13]] = True
    reset[1, [0, 15]] = True
    fn = (lambda x: chunkwise(x, reset=reset)) if form == "chunkwise" else (lambda x: recurrent(x, reset=reset))
    op = Op(chunkwise, recurrent, lambda x: reference(x, reset), state=OP.state, static=OP.static)
    check_reference(op, fn, make_inputs(21, requires_grad=True), 1e-10, grad_tol=1e-10)


def test_gradients_match_reference():
    check_gradients(OP, chunkwise, make_inputs(19, requires_grad=True), 1e-10)


def test_chunkwise_matches_recurrent_float32():
    check_forms_agree(OP, make_inputs(40, torch.float32), 16, 1e-5)


def test_split_sequence_with_carried_state_equals_one_call():
    # and decoding: one step at a time with the recurrent form, continuing from the chunkwise (S, A)
    check_split(OP, make_inputs(30), [11, 20], 1e-10, decode=(20, 30, 1))


def test_no_preconditioning_is_the_gated_delta_rule():
    """squash = 1 makes M = 1: the gated delta rule, whatever A does."""
    x = make_inputs(25)
    want = delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_alpha"], SCALE, initial_state=x["S0"], chunk_size=8)
    got = precond_delta_rule(*args(x), squash=1.0, initial_state=(x["S0"], x["A0"]), chunk_size=8)
    assert_close(got[0], want[0], 1e-12)
    assert_close(got[1][0], want[1], 1e-12)
    assert_close(reference(x, squash=1.0)[0], want[0], 1e-12)  # and the reference agrees


@pytest.mark.parametrize("decay", ["log_alpha", "log_alpha_a"])
def test_strong_decay_long_sequence_stays_finite(decay):
    check_strong_decay(OP, make_inputs(300), decay)


def test_bfloat16_inputs():
    check_bfloat16(OP, make_inputs(40, torch.float32))


def test_arguments_are_checked():
    x = make_inputs(5, torch.float32)
    check_backends(lambda **kw: precond_delta_rule(*args(x), **kw))
    with pytest.raises(ValueError, match="preconditioner state A"):
        precond_delta_rule(*args(x), initial_state=(x["S0"], x["A0"][..., :2]))
    with pytest.raises(ValueError, match="center"):
        precond_delta_rule(*args(x), center=torch.zeros(H + 1))
    with pytest.raises(ValueError, match="beta_a"):
        precond_delta_rule(*args(x)[:5], x["beta_a"][..., :1], x["log_alpha_a"])


def test_fla_glue_with_a_fake_fla(monkeypatch):
    """The fla adapter (fla's argument names and order, use_qk_l2norm_in_kernel off, x = squash, the center per head as
    log_atk_scale, (S, A) in and out; with resets the varlen form, both states per sequence), against a stand-in for
    fla's entry point that follows its documented semantics, since fla needs a GPU."""
    from lm.ops.fla import fla_precond_delta_rule

    calls = []

    def chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, scale=None, initial_state=None,
                                       initial_A_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
                                       cu_seqlens=None, x=1.5, eps=1e-6, log_atk_scale=None):
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and output_final_state and not use_qk_l2norm_in_kernel
        assert log_atk_scale.shape == (q.shape[2],)
        calls.append(cu_seqlens is not None)

        def run(t, n):  # one sequence: steps t of everything, initial states n
            out, state = precond_delta_rule_recurrent(
                t(q), t(k), t(v), t(beta), t(g), t(beta_atk), t(g_atk), scale, squash=x, eps=eps, center=log_atk_scale,
                initial_state=(initial_state[n], initial_A_state[n]))
            return out, *state

        if cu_seqlens is None:
            return run(lambda z: z, slice(None))
        pieces = [run(lambda z, lo=lo, hi=hi: z[:, lo:hi], slice(n, n + 1))
                  for n, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))]
        return torch.cat([p[0] for p in pieces], dim=1), *(torch.cat(parts) for parts in list(zip(*pieces))[1:])

    fake_module(monkeypatch, "fla.ops.precond_gated_delta_rule",
                chunk_precond_gated_delta_rule=chunk_precond_gated_delta_rule)
    x = make_inputs(20, torch.float32)
    x16 = {n: t.bfloat16() if n not in ("S0", "A0", "center") else t for n, t in x.items()}
    reset = torch.zeros(B, 20, dtype=torch.bool)
    reset[0, [6, 7]] = reset[1, 0] = True
    for r in (None, reset):
        out, (S, A) = fla_precond_delta_rule(*args(x16), SQUASH, EPS, x16["center"], (x16["S0"], x16["A0"]), r)
        out_ref, (S_ref, A_ref) = chunkwise(x16, reset=r)
        assert out.dtype == torch.bfloat16 and S.dtype == A.dtype == torch.float32
        assert_close(out.float(), out_ref.float(), 1e-2)
        assert_close(S, S_ref, 1e-4)
        assert_close(A, A_ref, 1e-4)
    assert calls == [False, True]


@pytest.fixture
def fresh_checks(monkeypatch):
    """No verdict, no notice said, and the self-check on (whatever the environment says)."""
    monkeypatch.delenv(self_check.ENV, raising=False)
    self_check.forget()
    warn_once.cache_clear()
    yield
    self_check.forget()
    warn_once.cache_clear()


@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
def test_the_fla_kernel_is_checked_against_the_torch_code(monkeypatch, fresh_checks, right):
    """The dispatch runs fla's self-check on its own seeded input (beta up to 2, a center per head, (S, A) to start
    from): a kernel that agrees is kept, one 10% off is caught, said, and the call computes the torch code's result
    (the kernel stood in for by the torch code, since fla needs a GPU)."""
    module = sys.modules["lm.ops.precond_delta_rule"]  # lm.ops.precond_delta_rule is the function
    monkeypatch.setattr(module, "use_fla", lambda backend, *tensors, **kw: backend == "fla")

    def kernel(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale, squash, eps, center, state, reset):
        out, (S, A) = precond_delta_rule(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale, squash=squash,
                                         eps=eps, center=center, initial_state=state, reset=reset, backend="torch")
        return (out, (S, A)) if right else (1.1 * out, (1.1 * S, A))

    monkeypatch.setattr(module, "fla_precond_delta_rule", kernel)
    x = {n: t if n in ("S0", "A0", "center") else t.bfloat16() for n, t in make_inputs(12, torch.float32).items()}

    def call(backend):
        out, state = precond_delta_rule(*args(x), center=x["center"], initial_state=(x["S0"], x["A0"]),
                                        backend=backend)
        return out, *state

    if right:
        call("fla")
    else:
        with pytest.warns(UserWarning, match="precond_delta_rule \\(fla chunk_precond_gated_delta_rule\\)"):
            torch.testing.assert_close(call("fla"), call("torch"), rtol=0, atol=0)
    [verdict] = self_check.verdicts().values()
    assert verdict.ok == right
    assert set(verdict.errors) >= {"out", "state", "precond_state", "dq", "dk", "dv", "dbeta", "dbeta_a", "dcenter",
                                   "dS0", "dA0"}

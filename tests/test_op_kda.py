"""lm.ops.kda: chunkwise and recurrent forms against a per-token reference of KDA with GDN-2's channel gates,
S_t = (I - k_t (b_t * k_t)^T) Diag(alpha_t) S_{t-1} + k_t (w_t * v_t)^T, o_t = scale * S_t^T q_t (b = w = beta: KDA),
with beta and b in [0, 2] (negative eigenvalues)."""

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
    check_zero_state_is_default,
    fake_module,
)

from lm.ops import delta_rule, kda, kda_recurrent, self_check
from lm.ops.common import warn_once
from lm.ops.kda import generalized_delta

B, H, K, V = 2, 2, 5, 3
SCALE = 0.7
SUB = 4


def reference(q, k, v, log_alpha, erase, write, scale, initial_state, reset=None):
    """The recurrence token by token with the explicit matrices: the decay Diag(alpha_t) first, then the erase
    I - k_t (b_t * k_t)^T, then the write k_t (w_t * v_t)^T; a reset zeroes the state before its step."""
    eye = torch.eye(K, dtype=q.dtype)
    state, outs = initial_state, []
    for t in range(q.shape[1]):
        if reset is not None:
            state = state * (~reset[:, t]).to(q.dtype)[:, None, None, None]
        alpha = torch.exp(log_alpha[:, t])
        decayed = (alpha[..., :, None] if alpha.dim() == 3 else alpha[..., None, None]) * state
        b = erase[:, t] if erase[:, t].dim() == 3 else erase[:, t, :, None]
        w = write[:, t] if write[:, t].dim() == 3 else write[:, t, :, None]
        transition = eye - k[:, t, :, :, None] * (b * k[:, t])[:, :, None, :]
        state = transition @ decayed + k[:, t, :, :, None] * (w * v[:, t])[:, :, None, :]
        outs.append(scale * (state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1), state


def make_inputs(T, dtype=torch.float64, seed=0, requires_grad=False, variant="kda"):
    """Unit keys; per-channel log-decays from strong to weak; beta (KDA) or the erase gate b (GDN-2) in [0, 2], the
    write gate w in [0, 1]; a random initial state. variant "per_head": KDA with one decay per head."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    uniform = lambda *shape: torch.rand(*shape, generator=g, dtype=dtype)  # noqa: E731
    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V),
             log_alpha=F.logsigmoid(2 * rand(B, T, H, *(() if variant == "per_head" else (K,))) + 1),
             initial_state=rand(B, H, K, V))
    if variant == "gdn2":
        x["erase"], x["write"] = 2 * uniform(B, T, H, K), uniform(B, T, H, V)
    else:
        x["beta"] = 2 * uniform(B, T, H)
    return {name: t.requires_grad_(requires_grad) for name, t in x.items()}


def gates(x):
    beta = x.get("beta")
    return x.get("erase", beta), x.get("write", beta)


def chunkwise(x, chunk_size=16, **kw):
    return kda(x["q"], x["k"], x["v"], x["log_alpha"], x.get("beta"), SCALE, erase=x.get("erase"),
               write=x.get("write"), initial_state=x["initial_state"], chunk_size=chunk_size, sub_chunk=SUB,
               backend="torch", **kw)


def recurrent(x, **kw):
    return kda_recurrent(x["q"], x["k"], x["v"], x["log_alpha"], x.get("beta"), SCALE, erase=x.get("erase"),
                         write=x.get("write"), initial_state=x["initial_state"], **kw)


def ref(x, reset=None):
    return reference(x["q"], x["k"], x["v"], x["log_alpha"], *gates(x), SCALE, x["initial_state"], reset)


OP = Op(chunkwise, recurrent, ref)
VARIANTS = pytest.mark.parametrize("variant", ["kda", "gdn2", "per_head"])


def resets(T):
    """Row 0: resets at a chunk's first step (16), inside a chunk (5) and on two steps in a row (30, 31); row 1: at
    step 0 (the carried state is dropped) and at a chunk's last step (15)."""
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, [5, 16, 30, 31]] = True
    reset[1, [0, 15]] = True
    return reset


@VARIANTS
@pytest.mark.parametrize("T,chunk_size", [(1, 16), (45, 16), (45, 8)])
def test_chunkwise_matches_reference_float64(T, chunk_size, variant):
    check_reference(OP, lambda x: chunkwise(x, chunk_size), make_inputs(T, variant=variant), 1e-10,
                    shapes=((B, T, H, V), [(B, H, K, V)]))


@VARIANTS
def test_recurrent_matches_reference_float64(variant):
    check_reference(OP, recurrent, make_inputs(19, variant=variant), 1e-10)


@VARIANTS
@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_resets_on_and_inside_a_chunk_match_the_reference_with_gradients(form, variant):
    """Outputs, final state and every input's gradient (the initial state's included), float64, at 1e-10."""
    reset = resets(37)
    fn = (lambda x: chunkwise(x, reset=reset)) if form == "chunkwise" else (lambda x: recurrent(x, reset=reset))
    op = Op(chunkwise, recurrent, lambda x: ref(x, reset))
    check_reference(op, fn, make_inputs(37, variant=variant, requires_grad=True), 1e-10, grad_tol=1e-10)


@VARIANTS
def test_gradients_match_reference(variant):
    check_gradients(OP, chunkwise, make_inputs(21, requires_grad=True, variant=variant), 1e-10)


@VARIANTS
def test_chunkwise_matches_recurrent_float32(variant):
    check_forms_agree(OP, make_inputs(50, torch.float32, variant=variant), 16, 1e-5)


def test_split_sequence_with_carried_state_equals_one_call():
    # and decoding: one step at a time with the recurrent form, continuing from the chunkwise state
    check_split(OP, make_inputs(40, variant="gdn2"), [13, 29], 1e-10, decode=(29, 40, 1))


def test_zero_initial_state_is_default():
    x = make_inputs(20)
    check_zero_state_is_default(OP, x, lambda x: kda(x["q"], x["k"], x["v"], x["log_alpha"], x["beta"], SCALE,
                                                     chunk_size=16, sub_chunk=SUB), recurrent_tol=1e-12)


def test_kda_is_gdn2_with_b_and_w_equal_to_beta():
    x = make_inputs(30)
    beta = x["beta"][..., None]
    gdn2 = dict(x, erase=beta.expand(B, 30, H, K), write=beta.expand(B, 30, H, V))
    del gdn2["beta"]
    for form in (chunkwise, recurrent):
        got, want = form(gdn2), form(x)
        assert_close(got[0], want[0], 1e-12)
        assert_close(got[1], want[1], 1e-12)


def test_one_decay_per_channel_equal_across_channels_is_the_gated_delta_rule():
    x = make_inputs(30, variant="per_head")
    per_channel = dict(x, log_alpha=x["log_alpha"][..., None].expand(B, 30, H, K))
    want = delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_alpha"], SCALE, initial_state=x["initial_state"],
                      chunk_size=16)
    for got in (chunkwise(x), chunkwise(per_channel), recurrent(per_channel)):
        assert_close(got[0], want[0], 1e-12)
        assert_close(got[1], want[1], 1e-12)


def test_strong_decay_long_sequence_stays_finite():
    check_strong_decay(OP, make_inputs(300), "log_alpha")


def test_strong_and_weak_channels_side_by_side_in_float32():
    """Channels of exp(-20) per step next to ones of exp(-0.01) for 300 steps: finite outputs and gradients in
    float32, within float32 accuracy of the float64 reference (the weak channels keep theirs: no exponent is a
    difference of large cumulative sums)."""
    x = make_inputs(300)
    x["log_alpha"][..., :2] = -20.0
    x["log_alpha"][..., 2:] = -0.01
    want = ref(x)
    x32 = {n: t.float().requires_grad_() for n, t in x.items()}
    out, state = chunkwise(x32, 64)
    assert_close(out.double(), want[0], 1e-4)
    assert_close(state.double(), want[1], 1e-4)
    (out.sum() + state.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in x32.values())


@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_bfloat16_inputs(variant):
    check_bfloat16(OP, make_inputs(40, torch.float32, variant=variant))


def test_arguments_are_checked():
    x = make_inputs(5, torch.float32)
    args = (x["q"], x["k"], x["v"], x["log_alpha"])
    check_backends(lambda **kw: kda(*args, x["beta"], **kw))
    with pytest.raises(ValueError, match="beta"):
        kda(*args, None, erase=x["log_alpha"])  # no write gate
    with pytest.raises(ValueError, match="write"):
        kda(*args, x["beta"], write=x["v"][..., :2])
    with pytest.raises(ValueError, match="log_alpha"):
        kda(x["q"], x["k"], x["v"], x["log_alpha"][..., :2], x["beta"])


def test_generalized_delta_padding_and_no_decay():
    """The core without a decay (log_alpha None) is DeltaNet: the delta rule with alpha = 1."""
    x = make_inputs(23, variant="per_head")
    k, beta = x["k"], x["beta"][..., None]
    out, state = generalized_delta(x["q"], beta * k, k, beta * x["v"], None, SCALE, x["initial_state"], None, 8)
    want = delta_rule(x["q"], k, x["v"], x["beta"], None, SCALE, initial_state=x["initial_state"], chunk_size=8)
    assert_close(out, want[0], 1e-12)
    assert_close(state, want[1], 1e-12)


@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_fla_glue_with_a_fake_fla(monkeypatch, variant):
    """The fla adapter (chunk_kda for a scalar beta, chunk_gdn2 for channel gates, g per channel, explicit scale,
    initial/final state; with resets the varlen form), against stand-ins for fla's entry points that follow fla's
    documented semantics, since fla needs a GPU."""
    from lm.ops.fla import fla_kda

    calls = []

    def varlen(fn):  # fla's varlen contract: one row, one initial state per sequence
        def call(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **gates):
            assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and g.shape == k.shape and output_final_state
            calls.append(fn.__name__)
            if cu_seqlens is None:
                return fn(q, k, v, g, scale, initial_state, **gates)
            outs, finals = [], []
            for n, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
                piece = {name: t[:, lo:hi] for name, t in gates.items()}
                out, final = fn(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], scale,
                                initial_state[n:n + 1], **piece)
                outs.append(out)
                finals.append(final)
            return torch.cat(outs, dim=1), torch.cat(finals)
        return call

    def chunk_kda(q, k, v, g, scale, initial_state, beta):
        return kda_recurrent(q, k, v, g, beta, scale, initial_state=initial_state)

    def chunk_gdn2(q, k, v, g, scale, initial_state, b, w):
        return kda_recurrent(q, k, v, g, None, scale, erase=b, write=w, initial_state=initial_state)

    fake_module(monkeypatch, "fla.ops.kda", chunk_kda=varlen(chunk_kda))
    fake_module(monkeypatch, "fla.ops.gdn2", chunk_gdn2=varlen(chunk_gdn2))
    x = make_inputs(37, torch.float32, variant=variant)
    x16 = {n: t.bfloat16() if n != "initial_state" else t for n, t in x.items()}
    erase, write = gates(x16)
    reset = resets(37)
    for r in (None, reset):
        out, state = fla_kda(x16["q"], x16["k"], x16["v"], x16["log_alpha"], x16.get("beta"), erase, write, SCALE,
                             x16["initial_state"], r)
        out_ref, state_ref = chunkwise(x16, reset=r)
        assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
        assert_close(out.float(), out_ref.float(), 1e-2)
        assert_close(state, state_ref, 1e-4)
    assert calls == ["chunk_kda" if variant == "kda" else "chunk_gdn2"] * 2


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
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_the_fla_kernel_is_checked_against_the_torch_code(monkeypatch, fresh_checks, variant, right):
    """The dispatch runs fla's self-check on its own seeded input (beta, b up to 2): a kernel that agrees is kept, one
    10% off is caught once, said, and the call computes the torch code's result (the kernel stood in for by the torch
    code, since fla needs a GPU)."""
    module = sys.modules["lm.ops.kda"]  # lm.ops.kda is the function
    monkeypatch.setattr(module, "use_fla", lambda backend, *tensors, **kw: backend == "fla")

    def kernel(q, k, v, log_alpha, beta, erase, write, scale, state, reset):
        out = kda(q, k, v, log_alpha, beta, scale, erase=erase, write=write, initial_state=state, reset=reset,
                  backend="torch")
        return out if right else tuple(1.1 * t for t in out)

    monkeypatch.setattr(module, "fla_kda", kernel)
    x = {n: t if n == "initial_state" else t.bfloat16()
         for n, t in make_inputs(37, torch.float32, variant=variant).items()}

    def call(backend):
        return kda(x["q"], x["k"], x["v"], x["log_alpha"], x.get("beta"), SCALE, erase=x.get("erase"),
                   write=x.get("write"), initial_state=x["initial_state"], reset=resets(37), backend=backend)

    if right:
        call("fla")
    else:
        with pytest.warns(UserWarning, match="kda \\(fla chunk_(kda|gdn2)\\): the fast kernel disagrees"):
            torch.testing.assert_close(call("fla"), call("torch"), rtol=0, atol=0)
    [verdict] = self_check.verdicts().values()
    assert verdict.ok == right and set(verdict.errors) >= {"out", "state", "dq", "dk", "dv", "dlog_alpha"}

"""lm.ops.delta_product: chunkwise and recurrent forms against a per-token reference of gated DeltaProduct: per token
the gate alpha_t once, then n_h steps S <- (I - beta k k^T) S + beta k v^T, each with its own k, v and beta in [0, 2];
o_t = scale * S_t^T q_t. The tests hold k, v and beta token-major ([B, T, n_h, ...]: a piece of tokens is a slice)
and give the op fla's layout, T * n_h rows."""

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

from lm.ops import delta_product, delta_product_recurrent, delta_rule, self_check
from lm.ops.common import warn_once

B, H, K, V = 2, 2, 4, 3
SCALE = 0.7


def reference(q, k, v, beta, log_alpha, scale, initial_state, reset=None):
    """Token by token with the explicit matrices; k, v, beta token-major [B, T, n_h, H, *]."""
    eye = torch.eye(K, dtype=q.dtype)
    state, outs = initial_state, []
    for t in range(q.shape[1]):
        if reset is not None:
            state = state * (~reset[:, t]).to(q.dtype)[:, None, None, None]
        if log_alpha is not None:
            state = torch.exp(log_alpha[:, t])[..., None, None] * state
        for j in range(k.shape[2]):
            k_j, v_j, b_j = k[:, t, j, :, :, None], v[:, t, j, :, None, :], beta[:, t, j, :, None, None]
            state = (eye - b_j * k_j * k_j.mT) @ state + b_j * k_j * v_j
        outs.append(scale * (state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1), state


def make_inputs(T, n_h=2, dtype=torch.float64, seed=0, requires_grad=False, gated=True):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, n_h, H, K), dim=-1), v=rand(B, T, n_h, H, V),
             beta=2 * torch.rand(B, T, n_h, H, generator=g, dtype=dtype), log_alpha=F.logsigmoid(rand(B, T, H) + 2),
             initial_state=rand(B, H, K, V))
    if not gated:
        del x["log_alpha"]
    return {name: t.requires_grad_(requires_grad) for name, t in x.items()}


def rows(x):
    """k, v, beta in fla's layout: T * n_h rows."""
    return [x[n].flatten(1, 2) for n in ("k", "v", "beta")]


def chunkwise(x, chunk_size=8, **kw):
    return delta_product(x["q"], *rows(x), x.get("log_alpha"), SCALE, initial_state=x["initial_state"],
                         chunk_size=chunk_size, backend="torch", **kw)


def recurrent(x, **kw):
    return delta_product_recurrent(x["q"], *rows(x), x.get("log_alpha"), SCALE, initial_state=x["initial_state"],
                                   **kw)


def ref(x, reset=None):
    return reference(x["q"], x["k"], x["v"], x["beta"], x.get("log_alpha"), SCALE, x["initial_state"], reset)


OP = Op(chunkwise, recurrent, ref)
N_H = pytest.mark.parametrize("n_h", [1, 2, 3])


@N_H
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_chunkwise_matches_reference_float64(n_h, gated):
    """T = 13 tokens: 13 n_h rows, never a whole number of chunks of 8."""
    check_reference(OP, chunkwise, make_inputs(13, n_h, gated=gated), 1e-10, shapes=((B, 13, H, V), [(B, H, K, V)]))


@N_H
def test_recurrent_matches_reference_float64(n_h):
    check_reference(OP, recurrent, make_inputs(7, n_h), 1e-10)


@pytest.mark.parametrize("n_h", [2, 3])
@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_resets_on_and_inside_a_chunk_match_the_reference_with_gradients(form, n_h):
    """Resets at tokens whose first row starts a chunk of 8 rows (token 4 of n_h = 2, token 8 of n_h = 3), inside
    chunks, twice in a row, and at step 0 of row 1: outputs, final state and every gradient, float64, 1e-10."""
    reset = torch.zeros(B, 15, dtype=torch.bool)
    reset[0, [3, 4, 8, 11, 12]] = True
    reset[1, [0, 9]] = True
    fn = (lambda x: chunkwise(x, reset=reset)) if form == "chunkwise" else (lambda x: recurrent(x, reset=reset))
    op = Op(chunkwise, recurrent, lambda x: ref(x, reset))
    check_reference(op, fn, make_inputs(15, n_h, requires_grad=True), 1e-10, grad_tol=1e-10)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_gradients_match_reference(gated):
    check_gradients(OP, chunkwise, make_inputs(11, 3, requires_grad=True, gated=gated), 1e-10)


def test_chunkwise_matches_recurrent_float32():
    check_forms_agree(OP, make_inputs(40, 3, torch.float32), 16, 1e-5)


def test_split_sequence_with_carried_state_equals_one_call():
    # and decoding: one token (its n_h steps) at a time, continuing from the chunkwise state
    check_split(OP, make_inputs(20, 2), [7, 13], 1e-10, decode=(13, 20, 1))


def test_one_householder_step_is_the_gated_delta_rule():
    x = make_inputs(21, 1)
    want = delta_rule(x["q"], x["k"][:, :, 0], x["v"][:, :, 0], x["beta"][:, :, 0], x["log_alpha"], SCALE,
                      initial_state=x["initial_state"], chunk_size=8)
    for got in (chunkwise(x), recurrent(x)):
        assert_close(got[0], want[0], 1e-12)
        assert_close(got[1], want[1], 1e-12)


def test_strong_decay_long_sequence_stays_finite():
    check_strong_decay(OP, make_inputs(300, 2), "log_alpha")


def test_bfloat16_inputs():
    check_bfloat16(OP, make_inputs(40, 2, torch.float32))


def test_arguments_are_checked():
    x = make_inputs(5, 2, torch.float32)
    k, v, beta = rows(x)
    check_backends(lambda **kw: delta_product(x["q"], k, v, beta, x["log_alpha"], **kw))
    with pytest.raises(ValueError, match="T \\* n_h"):
        delta_product(x["q"], k[:, :-1], v[:, :-1], beta[:, :-1])
    with pytest.raises(ValueError, match="T \\* n_h"):
        delta_product(x["q"], k, v, beta[:, :-2])
    with pytest.raises(ValueError, match="log_alpha"):
        delta_product(x["q"], k, v, beta, beta)


def test_fla_glue_with_a_fake_fla(monkeypatch):
    """The fla adapter (k, v, beta with T * n_h rows and num_householder, g per token, explicit scale, initial/final
    state; with resets the varlen form, its offsets in tokens), against a stand-in for fla's entry point that follows
    fla's documented semantics (cu_seqlens in tokens, the rows' offsets n_h times them), since fla needs a GPU."""
    from lm.ops.fla import fla_delta_product

    calls = []

    def chunk_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                                  output_final_state=False, cu_seqlens=None):
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and output_final_state
        n = num_householder
        calls.append(n)
        if cu_seqlens is None:
            return delta_product_recurrent(q, k, v, beta, g, scale, initial_state=initial_state)
        outs, finals = [], []
        for i, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            out, final = delta_product_recurrent(q[:, lo:hi], k[:, n * lo:n * hi], v[:, n * lo:n * hi],
                                                 beta[:, n * lo:n * hi], g[:, lo:hi], scale,
                                                 initial_state=initial_state[i:i + 1])
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals)

    fake_module(monkeypatch, "fla.ops.gated_delta_product", chunk_gated_delta_product=chunk_gated_delta_product)
    x = make_inputs(12, 3, torch.float32)
    x16 = {n: t.bfloat16() if n != "initial_state" else t for n, t in x.items()}
    reset = torch.zeros(B, 12, dtype=torch.bool)
    reset[0, [4, 5]] = reset[1, 0] = True
    for r in (None, reset):
        out, state = fla_delta_product(x16["q"], *rows(x16), x16["log_alpha"], SCALE, x16["initial_state"], r)
        out_ref, state_ref = chunkwise(x16, reset=r)
        assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
        assert_close(out.float(), out_ref.float(), 1e-2)
        assert_close(state, state_ref, 1e-4)
    assert calls == [3, 3]


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
    """The dispatch runs fla's self-check on its own seeded input (n_h rows a token, beta up to 2): a kernel that
    agrees is kept, one 10% off is caught, said, and the call computes the torch code's result (the kernel stood in
    for by the torch code, since fla needs a GPU)."""
    module = sys.modules["lm.ops.delta_product"]  # lm.ops.delta_product is the function
    monkeypatch.setattr(module, "use_fla", lambda backend, *tensors, **kw: backend == "fla")

    def kernel(q, k, v, beta, log_alpha, scale, state, reset):
        out = delta_product(q, k, v, beta, log_alpha, scale, initial_state=state, reset=reset, backend="torch")
        return out if right else tuple(1.1 * t for t in out)

    monkeypatch.setattr(module, "fla_delta_product", kernel)
    x = {n: t if n == "initial_state" else t.bfloat16() for n, t in make_inputs(12, 3, torch.float32).items()}

    def call(backend):
        return delta_product(x["q"], *rows(x), x["log_alpha"], SCALE, initial_state=x["initial_state"],
                             backend=backend)

    if right:
        call("fla")
    else:
        with pytest.warns(UserWarning, match="delta_product \\(fla chunk_gated_delta_product\\): the fast kernel"):
            torch.testing.assert_close(call("fla"), call("torch"), rtol=0, atol=0)
    [verdict] = self_check.verdicts().values()
    assert verdict.ok == right and set(verdict.errors) >= {"out", "state", "dq", "dk", "dv", "dbeta", "dlog_alpha"}

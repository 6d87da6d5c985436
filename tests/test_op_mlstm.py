"""lm.ops.mlstm: chunkwise and recurrent forms against a per-token reference of the unstabilised mLSTM
C_t = f_t C_{t-1} + exp(i_t) k_t v_t^T, n_t = f_t n_{t-1} + exp(i_t) k_t, h_t = C_t^T q^_t / max(|n_t^T q^_t|, 1)."""

import functools
import math
from dataclasses import replace

import pytest
import torch
from op_checks import (
    Op,
    assert_close,
    check_backends,
    check_forms_agree,
    check_gradients,
    check_reference,
    check_split,
    check_zero_state_is_default,
)

from lm.ops.mlstm import _kernel_unusable_reason, mlstm, mlstm_recurrent

B, H, K, V = 2, 3, 5, 7


def reference(q, k, v, i_pre, f_pre, C, n):
    """The unstabilised recurrence token by token, from the formulas (not the op's stabilised loop).

    C, n: the unstabilised initial state. Returns (h [B, T, H, V], (C, n))."""
    outs = []
    for t in range(q.shape[1]):
        f = torch.sigmoid(f_pre[:, t])[:, :, None]  # [B, H, 1]
        i = torch.exp(i_pre[:, t])[:, :, None]
        C = f[..., None] * C + i[..., None] * k[:, t, :, :, None] * v[:, t, :, None, :]
        n = f * n + i * k[:, t]
        q_hat = q[:, t] / math.sqrt(q.shape[-1])
        num = (C * q_hat[..., None]).sum(-2)  # C^T q^
        den = (n * q_hat).sum(-1).abs().clamp(min=1.0)  # max(|n^T q^|, 1)
        outs.append(num / den[..., None])
    return torch.stack(outs, dim=1), (C, n)


def make_inputs(T, dtype=torch.float64, seed=0, requires_grad=False, i_scale=2.0):
    """Inputs with gates in a realistic range (forget gates mostly near 1, input gates spanning several e-folds, so
    the stabiliser is exercised) and a random initial state in stabilised form (C~, n~, m)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)
    x = dict(
        q=rand(B, T, H, K),
        k=rand(B, T, H, K),
        v=rand(B, T, H, V),
        i_pre=i_scale * rand(B, T, H),
        f_pre=2.0 + 1.5 * rand(B, T, H),
        C=rand(B, H, K, V),
        n=rand(B, H, K),
        m=rand(B, H),
    )
    return {name: t.requires_grad_(requires_grad) for name, t in x.items()}


def args(x):
    return x["q"], x["k"], x["v"], x["i_pre"], x["f_pre"]


def state(x):
    return x["C"], x["n"], x["m"]


def chunkwise(x, chunk_size=16, eps=0.0, **kw):
    return mlstm(*args(x), eps=eps, initial_state=state(x), chunk_size=chunk_size, backend="torch", **kw)


def recurrent(x, eps=0.0):
    return mlstm_recurrent(*args(x), eps=eps, initial_state=state(x))


def ref(x):
    m = x["m"].exp()
    return reference(*args(x), x["C"] * m[..., None, None], x["n"] * m[..., None])


def unstabilised(s):
    """(C~, n~, m) -> (C, n): m itself may legitimately differ between forms, what the state stands for may not."""
    C, n, m = s
    return C * m.exp()[..., None, None], n * m.exp()[..., None]


OP = Op(chunkwise, recurrent, ref, state=("C", "n", "m"), exact=unstabilised)  # eps = 0: equal to the reference
EPS = replace(OP, chunkwise=functools.partial(chunkwise, eps=1e-6), recurrent=functools.partial(recurrent, eps=1e-6))


def relative_close(a, b, tol):
    """Close relative to the largest magnitude in b (entries far below it carry no information in float32)."""
    a, b = a.detach(), b.detach()
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("T, chunk_size", [(1, 16), (17, 16), (64, 16), (65, 16), (200, 16), (200, 64)])
def test_chunkwise_matches_reference(T, chunk_size):
    check_reference(OP, lambda x: chunkwise(x, chunk_size), make_inputs(T), 1e-10,
                    shapes=((B, T, H, V), [(B, H, K, V), (B, H, K), (B, H)]))


@pytest.mark.parametrize("T", [1, 17, 65])
def test_recurrent_matches_reference(T):
    check_reference(OP, recurrent, make_inputs(T, seed=1), 1e-10)


def test_zero_initial_state_is_none():
    check_zero_state_is_default(EPS, make_inputs(40), lambda x: mlstm(*args(x), chunk_size=16, backend="torch"),
                                recurrent_tol=1e-10)


@pytest.mark.parametrize("T, chunk_size", [(1, 64), (200, 64), (200, 16)])
def test_chunkwise_matches_recurrent_float32(T, chunk_size):
    # the same m recursion, so the stabilised states agree directly
    check_forms_agree(EPS, make_inputs(T, dtype=torch.float32, seed=2), chunk_size, 1e-5)


def test_eps_changes_output_by_about_eps():
    """h = C^T q^ / (max(|n^T q^|, 1) + eps exp(m)): a relative change of at most eps exp(m) per step."""
    x = make_inputs(130, seed=3, i_scale=1.0)
    exact, _ = chunkwise(x, eps=0.0)
    guarded, _ = chunkwise(x, eps=1e-6)
    rel = ((guarded - exact).abs() / exact.abs().clamp(min=1e-3)).max().item()
    assert 0 < rel < 1e-4


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_gradients_match_reference(form):
    """Gradients w.r.t. every input and the initial state, through the outputs and the (unstabilised) final state."""
    check_gradients(OP, chunkwise if form == "chunkwise" else recurrent, make_inputs(37, seed=4, requires_grad=True),
                    1e-9, seed=5)


def test_split_with_carried_state_matches_one_call():
    """Prefill in uneven pieces (chunkwise), then decode token by token (recurrent): same as one call, eps included."""
    check_split(EPS, make_inputs(90, seed=6), [33, 34, 80], 1e-10, decode=(80, 90, 1))


def test_extreme_gates_stay_finite_float32():
    """i_pre up to 1e3 and f_pre down to -1e3: exp(i_pre) and log(sigmoid(f_pre)) would overflow / give -inf."""
    T = 150
    x = make_inputs(T, dtype=torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    x["i_pre"] = 1e3 * (2 * torch.rand(B, T, H, generator=g) - 1)
    x["i_pre"][:, ::7] = 1e3
    x["f_pre"] = 1e3 * (2 * torch.rand(B, T, H, generator=g) - 1)
    x["f_pre"][:, 3::5] = -1e3
    for t in x.values():
        t.requires_grad_(True)
    out, final = chunkwise(x, 64, eps=1e-6)
    rec, rec_final = recurrent(x, eps=1e-6)
    assert torch.isfinite(out).all() and all(torch.isfinite(s).all() for s in final)
    relative_close(out, rec, 1e-4)
    for got, want in zip(final, rec_final):
        relative_close(got, want, 1e-4)
    grads = torch.autograd.grad(out.sum() + sum(s.sum() for s in final[:2]), list(x.values()))
    assert all(torch.isfinite(gr).all() for gr in grads)


def test_bfloat16_inputs():
    x = make_inputs(100, dtype=torch.float32, seed=9)
    x = {name: t.bfloat16() if name in ("q", "k", "v", "i_pre", "f_pre") else t for name, t in x.items()}
    out, final = chunkwise(x, 32, eps=1e-6)
    assert out.dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in final)
    x32 = {name: t.float() for name, t in x.items()}
    want, want_final = chunkwise(x32, 32, eps=1e-6)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)  # only the final cast rounds
    for got, w in zip(final, want_final):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)  # the state never leaves float32
    rec, _ = mlstm_recurrent(*args(x), initial_state=state(x))
    assert rec.dtype == torch.bfloat16


def test_backend_and_shape_checks():
    x = make_inputs(8)
    check_backends(lambda **kw: mlstm(*args(x), **kw), kernel="mlstm_kernels")
    out, _ = mlstm(*args(x), backend="auto")  # CPU: falls back to torch
    assert out.shape == (B, 8, H, V)
    with pytest.raises(ValueError, match="initial_state"):
        mlstm(*args(x), initial_state=(x["C"], x["n"]))
    with pytest.raises(ValueError):
        mlstm(x["q"], x["k"], x["v"], x["i_pre"][:, :, :1], x["f_pre"])


def test_matches_mlstm_kernels_native_code():
    """Same conventions (q / sqrt(K), max(|n~ . q^|, exp(-m)) + eps, state (C~, n~, m)) as mlstm_kernels' own PyTorch
    chunkwise code, which documents its Triton kernels. Skipped where mlstm_kernels is not installed."""
    kernels = pytest.importorskip("mlstm_kernels.torch")
    native = kernels.get_mlstm_kernel("chunkwise--native_autograd")
    x = make_inputs(64, seed=10, requires_grad=True)
    heads_first = lambda t: t.transpose(1, 2)
    q, k, v, i_pre, f_pre = (heads_first(t) for t in args(x))
    out, (C, n, m) = native(
        q=q, k=k, v=v, i=i_pre, f=f_pre, c_initial=x["C"], n_initial=x["n"], m_initial=x["m"][..., None],
        return_last_states=True, eps=0.0, chunk_size=16,
    )  # fmt: skip
    want, want_final = chunkwise(x)
    assert_close(heads_first(out), want, 1e-10)
    for got, ref_ in zip((C, n, m.squeeze(-1)), want_final):
        assert_close(got, ref_, 1e-10)
    w = torch.randn_like(want)
    got = torch.autograd.grad((heads_first(out) * w).sum(), list(x.values()))
    ref_grads = torch.autograd.grad((want * w).sum(), list(x.values()))
    for a, b in zip(got, ref_grads):
        assert_close(a, b, 1e-9)


# ----------------------------------------------------------------------------------------------------------------------
# reset: packed documents

# Row 0 keeps the carried state for its first document and has a reset at the last step of chunk 1 (15), at the first
# of chunk 2 (16) and three in a row (15, 16, 17: two one-token documents). Row 1 resets at step 0 (the carried state
# is dropped), at the last step of chunk 0 (7), at the first of chunks 1 and 3 (8, 24), twice in a row (11, 12) and at
# the very last step (36, in the padded last chunk). With chunk_size 8.
RESETS_37 = [[5, 15, 16, 17, 30], [0, 7, 8, 11, 12, 24, 36]]
RESETS_6 = [[2, 3], [0, 5]]  # T < chunk_size: one chunk


def reset_mask(T, resets):
    reset = torch.zeros(B, T, dtype=torch.bool)
    for b, steps in enumerate(resets):
        reset[b, steps] = True
    return reset


def per_document(x, reset, run):
    """Each row cut at its resets, every document run alone by run(inputs, initial_state or None): the first one
    from the row's carried state (unless it resets at step 0), the others from zero. Returns the outputs put back
    together [B, T, H, V] and the last documents' final states, batched."""
    outs, finals = [], []
    for b in range(B):
        T = reset.shape[1]
        cuts = sorted({0, T, *reset[b].nonzero().flatten().tolist()})
        carried = tuple(s[b : b + 1] for s in state(x))
        row = []
        for lo, hi in zip(cuts, cuts[1:]):
            doc = [t[b : b + 1, lo:hi] for t in args(x)]
            out, final = run(doc, carried if lo == 0 and not reset[b, 0] else None)
            row.append(out)
        outs.append(torch.cat(row, dim=1))
        finals.append(final)
    return torch.cat(outs), tuple(torch.cat(s) for s in zip(*finals))


def reference_alone(doc, init):
    """The unstabilised reference (eps = 0) on one document; init (C~, n~, m) or None for zeros."""
    if init is None:
        C, n = torch.zeros(1, H, K, V, dtype=doc[0].dtype), torch.zeros(1, H, K, dtype=doc[0].dtype)
    else:
        C, n = unstabilised(init)
    return reference(*doc, C, n)


def recurrent_alone(doc, init, eps=1e-6):
    return mlstm_recurrent(*doc, eps=eps, initial_state=init)


def chunkwise_alone(doc, init, eps=1e-6):
    return mlstm(*doc, eps=eps, initial_state=init, chunk_size=8, backend="torch")


@pytest.mark.parametrize("T, resets", [(37, RESETS_37), (6, RESETS_6)])
def test_reset_equals_documents_run_alone(T, resets):
    """Packed rows against every document run alone: the unstabilised reference with eps = 0, and the ops themselves
    with the default eps = 1e-6 (a reset must clear m too, or the eps-guarded denominator differs)."""
    x, reset = make_inputs(T, seed=11), reset_mask(T, resets)
    ref_out, ref_final = per_document(x, reset, reference_alone)
    for eps in (0.0, 1e-6):
        packed = {
            "chunkwise": mlstm(*args(x), eps=eps, initial_state=state(x), chunk_size=8, backend="torch", reset=reset),
            "recurrent": mlstm_recurrent(*args(x), eps=eps, initial_state=state(x), reset=reset),
        }
        alone = [per_document(x, reset, functools.partial(run, eps=eps)) for run in (recurrent_alone, chunkwise_alone)]
        for out, final in packed.values():
            if eps == 0.0:
                assert_close(out, ref_out, 1e-9)
                for got, want in zip(unstabilised(final), ref_final):
                    assert_close(got, want, 1e-9)
            for want_out, want_final in alone:
                assert_close(out, want_out, 1e-9)
                for got, want in zip(final, want_final):  # the same m recursion: the stabilised states agree, m too
                    assert_close(got, want, 1e-9)


def test_reset_gradients():
    """Gradients of the packed chunkwise call w.r.t. every input and the initial state: those of the per-document
    reference (eps = 0) and of the recurrent form with reset (eps = 1e-6)."""
    T, reset = 37, reset_mask(37, RESETS_37)
    x = make_inputs(T, seed=12, requires_grad=True)
    g = torch.Generator().manual_seed(13)
    w_out, w_C, w_n = (
        torch.randn(*s, generator=g, dtype=torch.float64) for s in [(B, T, H, V), (B, H, K, V), (B, H, K)]
    )

    def loss(out, C, n):
        return (out * w_out).sum() + (C * w_C).sum() + (n * w_n).sum()

    def grads(out, final_Cn):
        return torch.autograd.grad(loss(out, *final_Cn), list(x.values()))

    for eps in (0.0, 1e-6):
        out, final = mlstm(*args(x), eps=eps, initial_state=state(x), chunk_size=8, backend="torch", reset=reset)
        got = grads(out, unstabilised(final))
        if eps == 0.0:
            want = grads(*per_document(x, reset, reference_alone))
        else:
            rec, rec_final = mlstm_recurrent(*args(x), eps=eps, initial_state=state(x), reset=reset)
            want = grads(rec, unstabilised(rec_final))
        for name, a, b in zip(x, got, want):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8, msg=lambda m, name=name: f"d/d{name}: {m}")


def test_reset_token_by_token_matches_one_call():
    """Decoding the packed row one token at a time, carrying the state and passing each token's reset."""
    T, reset = 37, reset_mask(37, RESETS_37)
    x = make_inputs(T, seed=14)
    whole, whole_final = mlstm(*args(x), initial_state=state(x), chunk_size=8, backend="torch", reset=reset)
    s, outs = state(x), []
    for t in range(T):
        out, s = mlstm_recurrent(*(a[:, t : t + 1] for a in args(x)), initial_state=s, reset=reset[:, t : t + 1])
        outs.append(out)
    assert_close(torch.cat(outs, dim=1), whole, 1e-10)
    for got, want in zip(s, whole_final):
        assert_close(got, want, 1e-10)


def test_reset_extreme_gates_stay_finite_float32():
    """i_pre up to 1e3 and f_pre down to -1e3 with resets (also at chunk edges and in a row): finite outputs,
    states and gradients, and the chunkwise form still agrees with the recurrent one."""
    T = 150
    x = make_inputs(T, dtype=torch.float32, seed=15)
    g = torch.Generator().manual_seed(16)
    x["i_pre"] = 1e3 * (2 * torch.rand(B, T, H, generator=g) - 1)
    x["i_pre"][:, ::7] = 1e3
    x["f_pre"] = 1e3 * (2 * torch.rand(B, T, H, generator=g) - 1)
    x["f_pre"][:, 3::5] = -1e3
    for t in x.values():
        t.requires_grad_(True)
    reset = torch.rand(B, T, generator=g) < 0.1
    reset[0, [0, 63, 64, 65, 66, 127, 149]] = True
    reset[1, [1, 2, 128]] = True
    out, final = chunkwise(x, 64, eps=1e-6, reset=reset)
    rec, rec_final = mlstm_recurrent(*args(x), eps=1e-6, initial_state=state(x), reset=reset)
    assert torch.isfinite(out).all() and all(torch.isfinite(s).all() for s in final)
    relative_close(out, rec, 1e-4)
    for got, want in zip(final, rec_final):
        relative_close(got, want, 1e-4)
    for o, f in ((out, final), (rec, rec_final)):
        grads = torch.autograd.grad(o.sum() + sum(s.sum() for s in f[:2]), list(x.values()))
        assert all(torch.isfinite(gr).all() for gr in grads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_no_reset_is_unchanged(dtype):
    """reset=None and an all-False reset compute the same, bit for bit, in both forms."""
    x = make_inputs(37, dtype=dtype, seed=17)
    no = torch.zeros(B, 37, dtype=torch.bool)
    for run in (
        lambda **kw: mlstm(*args(x), initial_state=state(x), chunk_size=8, backend="torch", **kw),
        lambda **kw: mlstm_recurrent(*args(x), initial_state=state(x), **kw),
    ):
        (out, final), (out0, final0) = run(), run(reset=no)
        assert torch.equal(out, out0) and all(torch.equal(a, b) for a, b in zip(final, final0))


def test_reset_checks_and_backend():
    x, reset = make_inputs(8), reset_mask(8, [[3], [0]])
    with pytest.raises(RuntimeError, match="reset"):
        mlstm(*args(x), backend="mlstm_kernels", reset=reset)
    assert _kernel_unusable_reason(*args(x)[:3], None, 16, reset) == "it has no reset / varlen support"
    out, _ = mlstm(*args(x), backend="auto", reset=reset)  # goes to torch
    assert out.shape == (B, 8, H, V)
    for bad in (reset[:, :5], reset.long(), reset[:1]):
        for op in (mlstm, mlstm_recurrent):
            with pytest.raises(ValueError, match="reset"):
                op(*args(x), reset=bad)

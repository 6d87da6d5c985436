"""lm.ops.mesa: chunkwise and recurrent Mesa layer against a per-token reference that materialises
G_t = gamma_t G_{t-1} + beta_t v_t k_t^T and H_t = gamma_t H_{t-1} + beta_t k_t k_t^T and solves
(H_t + diag(lam)) x_t = q_t with torch.linalg.solve; o_t = G_t x_t."""

import pytest
import torch
import torch.nn.functional as F
from op_checks import Op, check_backends, check_forms_agree, check_reference, check_split, fake_module

from lm.ops.linear_attention import linear_attention
from lm.ops.mesa import mesa, mesa_recurrent

B, H, K, V = 2, 3, 6, 5
EXACT_STEPS = K + 6  # CG solves a K x K system in K steps in exact arithmetic; a few more absorb rounding


def reference(q, k, v, log_gamma, beta, lam, initial_state, reset=None):
    """The layer written out token by token with an exact solve, independently of the op; a reset clears both
    states before its step."""
    G, Hs = initial_state
    outs = []
    for t in range(q.shape[1]):
        gamma = log_gamma[:, t].exp()[:, :, None, None]
        if reset is not None:
            gamma = gamma * (~reset[:, t]).to(gamma.dtype)[:, None, None, None]
        k_beta = beta[:, t, :, None] * k[:, t]
        G = gamma * G + v[:, t, :, :, None] * k_beta[:, :, None, :]  # + beta v k^T: [B, H, V, K]
        Hs = gamma * Hs + k_beta[:, :, :, None] * k[:, t, :, None, :]  # + beta k k^T: [B, H, K, K]
        x = torch.linalg.solve(Hs + torch.diag_embed(lam), q[:, t, :, :, None])
        outs.append((G @ x)[..., 0])
    return torch.stack(outs, dim=1), (G, Hs)


def make_inputs(T, dtype=torch.float64, seed=0, requires_grad=False, shape=(B, H, K, V)):
    """Random inputs: beta in (0, 1), log-decay in [-1, 0], lam in [0.5, 1.5], a random state with H_0 symmetric
    positive semi-definite."""
    b, h, kd, vd = shape
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    M = rand(b, h, kd, kd)
    x = dict(
        q=rand(b, T, h, kd),
        k=rand(b, T, h, kd),
        v=rand(b, T, h, vd),
        log_gamma=-torch.rand(b, T, h, generator=g, dtype=dtype),
        beta=torch.rand(b, T, h, generator=g, dtype=dtype),
        lam=0.5 + torch.rand(h, kd, generator=g, dtype=dtype),
        G0=rand(b, h, vd, kd),
        H0=M @ M.mT / kd,
    )
    return {name: t.requires_grad_(requires_grad) for name, t in x.items()}


def args(x):
    return x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], x["lam"]


def chunkwise(x, chunk_size=16, cg_steps=EXACT_STEPS, **kw):
    return mesa(*args(x), cg_steps=cg_steps, initial_state=(x["G0"], x["H0"]), chunk_size=chunk_size,
                backend="torch", **kw)


def recurrent(x, cg_steps=EXACT_STEPS, **kw):
    return mesa_recurrent(*args(x), cg_steps=cg_steps, initial_state=(x["G0"], x["H0"]), **kw)


def ref(x):
    return reference(*args(x), (x["G0"], x["H0"]))


OP = Op(chunkwise, recurrent, ref, state=("G0", "H0"), static=("lam",))


def assert_close(a, b, tol, msg=None):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=msg)


def realistic_inputs(T, Kd, dtype=torch.float32, seed=0, b=2, h=2, Vd=None):
    """The setting of the paper: L2-normalised q and k, beta = sigmoid, gamma = sigmoid(. + 3), lam = 0.25 +
    softplus, so lam is about 1. V = K unless Vd is given."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    return dict(
        q=F.normalize(rand(b, T, h, Kd), dim=-1),
        k=F.normalize(rand(b, T, h, Kd), dim=-1),
        v=rand(b, T, h, Vd or Kd),
        log_gamma=F.logsigmoid(rand(b, T, h) + 3),
        beta=torch.sigmoid(rand(b, T, h)),
        lam=0.25 + F.softplus(rand(h, Kd)),
    )


# ----------------------------------------------------------------------------------------------------------------------
# exactness


@pytest.mark.parametrize("T,chunk_size", [(1, 16), (33, 16), (64, 16), (130, 16), (130, 64)])
def test_chunkwise_matches_reference_float64(T, chunk_size):
    check_reference(OP, lambda x: chunkwise(x, chunk_size), make_inputs(T), 1e-8,
                    shapes=((B, T, H, V), [(B, H, V, K), (B, H, K, K)]))


@pytest.mark.parametrize("T", [1, 33])
def test_recurrent_matches_reference_float64(T):
    check_reference(OP, recurrent, make_inputs(T), 1e-8)


def test_zero_initial_state_is_default():
    x = make_inputs(40)
    x["G0"], x["H0"] = torch.zeros_like(x["G0"]), torch.zeros_like(x["H0"])
    out, (G, Hs) = mesa(*args(x), cg_steps=EXACT_STEPS, chunk_size=16)
    out_ref, (G_ref, H_ref) = ref(x)
    assert_close(out, out_ref, 1e-8)
    assert_close(G, G_ref, 1e-12)
    assert_close(Hs, H_ref, 1e-12)
    out_rec, _ = mesa_recurrent(*args(x), cg_steps=EXACT_STEPS)
    assert_close(out_rec, out_ref, 1e-8)


def test_cg_steps_zero_is_linear_attention_with_query_q():
    x = make_inputs(45, requires_grad=True)
    out, (G, Hs) = chunkwise(x, cg_steps=0)
    want, S = linear_attention(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], initial_state=x["G0"].mT,
                               chunk_size=16, backend="torch")
    assert_close(out, want, 1e-12)
    assert_close(G, S.mT, 1e-12)
    assert_close(Hs, ref(x)[1][1], 1e-10)  # H is still carried, for a later call with cg_steps > 0
    out_rec, (G_rec, H_rec) = recurrent(x, cg_steps=0)
    assert_close(out_rec, want, 1e-12)
    assert_close(H_rec, Hs, 1e-10)
    # plain autograd through linear attention: gradients flow to everything, H_0 only through the final H
    (out.sum() + Hs.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for n, t in x.items() if n != "lam")
    assert x["lam"].grad is None  # no solve, so lam is unused


def test_cg_matvec_is_linear_attention_with_keys_as_values():
    """The CG's cached chunked operator: H_t p_t equals linear_attention(p, k, k, initial_state=H_0^T), and its
    diagonal equals diag(H_t) of the materialised states (T not a multiple of the chunk)."""
    from lm.ops.common import from_head_chunks, to_head_chunks
    from lm.ops.mesa import _ChunkedKeyState

    x = make_inputs(45)
    x["H0"] = x["H0"] + 0.3 * torch.randn(B, H, K, K, dtype=torch.float64)  # not symmetric: orientation matters
    p = torch.randn(B, 45, H, K, dtype=torch.float64)
    op = _ChunkedKeyState(x["k"], x["log_gamma"], x["beta"], x["H0"], None, 16, torch.float64)
    want, H_T = linear_attention(p, x["k"], x["k"], x["log_gamma"], x["beta"], initial_state=x["H0"].mT,
                                 chunk_size=16, backend="torch")
    assert_close(from_head_chunks(op.matvec(to_head_chunks(p, 16, torch.float64)), 45), want, 1e-12)
    assert_close(op.final, H_T.mT, 1e-12)
    Hs, diags = x["H0"], []
    for t in range(45):
        Hs = x["log_gamma"][:, t].exp()[..., None, None] * Hs + x["beta"][:, t, :, None, None] * (
            x["k"][:, t, :, :, None] * x["k"][:, t, :, None, :])
        diags.append(Hs.diagonal(dim1=-2, dim2=-1))
    assert_close(from_head_chunks(op.diagonal(), 45), torch.stack(diags, 1), 1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# gradients (implicit differentiation)


@pytest.mark.parametrize("T,chunk_size,loss_on", [(33, 16, "both"), (70, 64, "both"), (20, 16, "out"),
                                                  (20, 16, "state")])
def test_gradients_match_reference(T, chunk_size, loss_on):
    x = make_inputs(T, requires_grad=True)
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((B, T, H, V), (B, H, V, K), (B, H, K, K))]

    def loss(res):
        out, (G, Hs) = res
        terms = {"out": (out * w[0]).sum(), "state": (G * w[1]).sum() + (Hs * w[2]).sum()}
        return terms[loss_on] if loss_on in terms else sum(terms.values())

    inputs = list(x.values())
    grads = torch.autograd.grad(loss(chunkwise(x, chunk_size)), inputs, allow_unused=True)
    grads_ref = torch.autograd.grad(loss(ref(x)), inputs, allow_unused=True)
    for name, a, b in zip(x, grads, grads_ref):
        if b is None:  # e.g. q, lam with a loss on the states only
            assert a is None or a.abs().max() == 0, name
            continue
        assert_close(a, b, 1e-6, msg=f"gradient w.r.t. {name}")
    if T > 40:
        return
    # the recurrent form (plain autograd through its CG steps) agrees too
    grads_rec = torch.autograd.grad(loss(recurrent(x)), inputs, allow_unused=True)
    for name, a, b in zip(x, grads_rec, grads_ref):
        if b is not None:
            assert_close(a, b, 1e-6, msg=f"recurrent gradient w.r.t. {name}")


def test_gradcheck():
    """torch.autograd.gradcheck of the custom backward on a small case (H_0 built symmetric from a free matrix, so
    that the finite differences stay on symmetric H_0, where the layer is defined)."""
    x = make_inputs(5, shape=(1, 1, 3, 2), seed=3, requires_grad=True)
    M = torch.randn(1, 1, 3, 3, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, log_gamma, beta, lam, G0, M):
        out, (G, Hs) = mesa(q, k, v, log_gamma, beta, lam, cg_steps=20, initial_state=(G0, M @ M.mT), chunk_size=2,
                            backend="torch")
        return out, G, Hs

    inputs = (*args(x), x["G0"], M)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# forms, state passing, tolerance


@pytest.mark.parametrize("T", [17, 70])
def test_recurrent_equals_chunkwise(T):
    check_forms_agree(OP, make_inputs(T, seed=2), 16, 1e-8, state_tol=1e-10)


def test_split_sequence_with_carried_state_equals_one_call():
    # and decoding: two steps with the recurrent form, continuing from the chunkwise state
    check_split(OP, make_inputs(100, seed=4), [37], 1e-8, state_tol=1e-10, decode=(37, 39, 2))


def test_tolerance_saves_iterations_at_small_error():
    """cg_tol=1e-4 against 30 steps without a tolerance (converged in float32: relative residual < 1e-10) in the
    paper's setting, K=64, T=256. Stopping at ||r|| <= tol ||r_0|| leaves an error in x of at most
    tol ||r_0|| / lam_min(A) per token, i.e. a relative error of about cond(A) * tol, with cond(A) = O(10) here (lam
    ~ 1, L2-normalised keys, gamma ~ 0.95): measured about 1.5e-5 relative (RMS) at 11.5 mean steps, so 1e-3
    leaves room for other seeds while still catching a solver that stops too early."""
    x = realistic_inputs(T=256, Kd=64)
    out30, _, info30 = mesa(*x.values(), cg_steps=30, return_info=True)
    out, _, info = mesa(*x.values(), cg_steps=30, cg_tol=1e-4, return_info=True)
    err = ((out - out30).norm() / out30.norm()).item()
    err_max = ((out - out30).abs().max() / out30.abs().max()).item()
    print(f"\ncg_tol=1e-4: mean CG iterations {info['iterations'].item():.2f} (30 without tol), relative error vs 30 "
          f"steps {err:.2e} (max-abs relative {err_max:.2e}); residual mean {info['residual'].item():.2e} max "
          f"{info['residual_max'].item():.2e}; 30 steps: residual max {info30['residual_max'].item():.1e}")
    assert info30["iterations"] == 30 and info30["residual_max"] < 1e-6
    assert info["iterations"] < 20
    assert info["residual_max"] <= 1e-4
    assert err < 1e-3 and err_max < 1e-3
    # the recurrent form stops by the same rule
    cut = {n: t[:1, :64] for n, t in x.items() if n != "lam"}
    _, _, info_c = mesa(*cut.values(), x["lam"], cg_steps=30, cg_tol=1e-4, return_info=True)
    _, _, info_r = mesa_recurrent(*cut.values(), x["lam"], cg_steps=30, cg_tol=1e-4, return_info=True)
    assert abs(info_c["iterations"] - info_r["iterations"]) < 0.05


FORWARD_INFO = {"iterations", "iterations_run", "residual", "residual_max", "diag_ratio"}
ADJOINT_INFO = {"adjoint_iterations", "adjoint_iterations_run", "adjoint_residual", "adjoint_residual_max"}


@pytest.mark.parametrize("cg_tol", [None, 1e-3])
def test_return_info(cg_tol):
    x = make_inputs(50, requires_grad=True)
    out, _, info = chunkwise(x, cg_steps=4, cg_tol=cg_tol, return_info=True)
    _, _, info_rec = recurrent(x, cg_steps=4, cg_tol=cg_tol, return_info=True)
    assert set(info) == set(info_rec) == FORWARD_INFO
    out.sum().backward()
    assert set(info) == FORWARD_INFO | ADJOINT_INFO  # the backward filled in its adjoint solve
    for stats in (info, info_rec):
        assert all(isinstance(t, torch.Tensor) and t.dim() == 0 and not t.requires_grad for t in stats.values())
        assert 0 < stats["iterations"] <= 4
        assert torch.isfinite(stats["residual"]) and 0 <= stats["residual"] <= stats["residual_max"]
        assert stats["iterations"] <= stats["iterations_run"] <= 4  # a loop runs until its slowest token is done
    if cg_tol is None:  # no early stop: every token takes every step
        assert info["iterations"] == info_rec["iterations"] == info["adjoint_iterations"] == 4
        assert info["iterations_run"] == info_rec["iterations_run"] == info["adjoint_iterations_run"] == 4
    _, _, info0 = chunkwise(x, cg_steps=0, return_info=True)
    assert info0["iterations"] == 0 and info0["residual"] == 1


def materialised_states(q, k, v, log_gamma, beta, lam, G0, H0):
    """G_t and A_t = H_t + diag(lam) for every token, [B, T, H, V, K] and [B, T, H, K, K], written out per step."""
    Gs, As, G, Hs = [], [], G0, H0
    for t in range(q.shape[1]):
        gamma = log_gamma[:, t].exp()[:, :, None, None]
        k_beta = beta[:, t, :, None] * k[:, t]
        G = gamma * G + v[:, t, :, :, None] * k_beta[:, :, None, :]
        Hs = gamma * Hs + k_beta[:, :, :, None] * k[:, t, :, None, :]
        Gs.append(G)
        As.append(Hs + torch.diag_embed(lam))
    return torch.stack(Gs, 1), torch.stack(As, 1)


def relative_residuals(A, x, b):
    """||b_t - A_t x_t|| / ||b_t|| per token and head."""
    return (b - (A @ x[..., None])[..., 0]).norm(dim=-1) / b.norm(dim=-1)


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_logged_residuals_are_the_true_residuals(form):
    """With v = 0, G_0 = I and no decay, G_t = I, so the output is the solve's x itself and the gradient w.r.t. q is
    the adjoint's e = A^{-1} do. Their residuals, recomputed here on materialised A_t, are what info reports; 3 CG
    steps leave them far from 0 (and far above CG's recursive residual, which info used to report)."""
    T, kd = 45, 6
    x = make_inputs(T, requires_grad=True, shape=(B, H, kd, kd))
    with torch.no_grad():
        x["v"].zero_()
        x["log_gamma"].zero_()
        x["G0"].copy_(torch.eye(kd).expand(B, H, kd, kd))
    steps = 3
    if form == "chunkwise":
        out, _, info = chunkwise(x, cg_steps=steps, return_info=True)
    else:
        out, _, info = recurrent(x, cg_steps=steps, return_info=True)
    do = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    (out * do).sum().backward()
    _, A = materialised_states(*(t.detach() for t in args(x)), x["G0"].detach(), x["H0"].detach())
    forward = relative_residuals(A, out.detach(), x["q"].detach())
    assert forward.min() > 1e-4  # not converged: the figures below mean something
    assert_close(info["residual"], forward.mean().float(), 1e-5)
    assert_close(info["residual_max"], forward.max().float(), 1e-5)
    assert info["iterations"] == steps
    if form == "chunkwise":  # the recurrent form (decoding) reports no adjoint statistics
        adjoint = relative_residuals(A, x["q"].grad, do)
        assert_close(info["adjoint_residual"], adjoint.mean().float(), 1e-5)
        assert_close(info["adjoint_residual_max"], adjoint.max().float(), 1e-5)
        assert info["adjoint_iterations"] == steps
    diag_ratio = A.diagonal(dim1=-2, dim2=-1).sub(x["lam"].detach()).max() / x["lam"].min()
    assert_close(info["diag_ratio"], diag_ratio.float(), 1e-5)


def test_adjoint_stops_at_the_tolerance_too():
    x = realistic_inputs(T=128, Kd=32, seed=2)
    x = {n: t.requires_grad_() for n, t in x.items()}
    out, _, info = mesa(*x.values(), cg_steps=30, cg_tol=1e-4, return_info=True)
    out.square().sum().backward()
    assert 0 < info["adjoint_iterations"] < 30 and info["adjoint_residual_max"] < 1e-3


# ----------------------------------------------------------------------------------------------------------------------
# under autocast: the solve stays in float32


def clustered_inputs(T=256, Kd=16, h=2, seed=0):
    """Legitimate but ill-conditioned: keys within about 0.05 of one direction per head, lam at its floor 0.25, slow
    decay. H_t is then nearly rank one, with an eigenvalue about T times lam's."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g)
    direction = F.normalize(rand(h, Kd), dim=-1)
    return dict(
        q=F.normalize(rand(1, T, h, Kd), dim=-1),
        k=F.normalize(direction + 0.05 * rand(1, T, h, Kd), dim=-1),
        v=rand(1, T, h, Kd),
        log_gamma=torch.full((1, T, h), 0.999).log(),
        beta=torch.full((1, T, h), 0.9),
        lam=torch.full((h, Kd), 0.25),
    )


def output_and_grads(x, autocast: bool):
    """mesa's output and the gradients of a fixed projection of it w.r.t. every input, in float64 for comparison.
    The projection is drawn once in float64 and cast, so every dtype differentiates the same loss (randn from one
    seed draws other numbers in float32 than in float64)."""
    x = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    proj = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    proj = proj.to(x["v"].dtype)
    exact = x["q"].dtype == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, _ = mesa(*x.values(), cg_steps=64 if exact else 30, chunk_size=64)
        (out * proj).sum().backward()
    return [out.detach().double()] + [t.grad.double() for t in x.values()]


def relative_error(a, b):
    """||a - b|| / ||b|| in float64, and 0 where both are 0 (a gradient that is exactly 0, as it should be)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def test_solve_is_float32_under_bf16_autocast():
    """Lightning's bf16-mixed wraps the forward (and here the backward) in autocast: the output and every input
    gradient must be as close to the float64 exact solve as a plain float32 call is (within 4x), and that is close:
    the reference is the same loss. Measured: plain float32 within 1e-5 of the exact solve everywhere, autocast
    identical to it; with the forward's matmuls left to autocast, the output was 8e-2 away; with the backward's
    (autocast_off dropped from `_MesaFunction.backward`), the gradients 1.5e-2 (v) to 0.19 (q)."""
    x = clustered_inputs()
    exact = output_and_grads({n: t.double() for n, t in x.items()}, autocast=False)
    plain = output_and_grads(x, autocast=False)
    autocast = output_and_grads(x, autocast=True)
    for name, e, p, a in zip(["out", *x], exact, plain, autocast):
        assert relative_error(p, e) < 1e-4, name
        assert relative_error(a, e) <= 4 * relative_error(p, e) + 1e-12, name


def clustered_key_model():
    """A 2-layer Mesa model set up for clustered keys: every key channel is about silu(w . x) (one direction per
    head), Lambda at its floor, gamma near 1 and beta near 1."""
    from lm.model import LanguageModel, LMConfig

    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, mixer="mesa",
                                   max_seq_len=256))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            m = block.mixer
            m.k_conv.weight.zero_()
            m.k_conv.weight[..., -1] = 1.0
            m.k_proj.weight.copy_(torch.randn(1, 32, generator=g) + 0.05 * torch.randn(32, 32, generator=g))
            m.gamma_proj.bias.fill_(8.0)
            m.beta_proj.bias.fill_(3.0)
            m.lam_raw.fill_(-20.0)
    return model


def test_model_loss_under_bf16_autocast(monkeypatch):
    """The same at the loss of a 2-layer model under autocast, per token: the solve as the model calls it is within 4x
    of the plain float32 call (the op with autocast off) from the float64 exact solve, both fed the same bf16
    projections. Measured: equal; with the matmuls left to autocast, 25-50x further."""
    from lm.ops.call import FORMS, Forms

    op = FORMS["mesa"].chunkwise

    def plain(*a, **kw):
        with torch.autocast("cpu", enabled=False):
            return op(*a, **kw)

    def exact(q, k, v, log_gamma, beta, lam, *, return_info=False, **_):
        out, state = op(*(t.double() for t in (q, k, v, log_gamma, beta, lam)), cg_steps=64)
        return (out.to(q.dtype), state, {}) if return_info else (out.to(q.dtype), state)

    model = clustered_key_model()
    ids = torch.randint(0, 64, (2, 257), generator=torch.Generator().manual_seed(10))
    nll = {}
    for name, fn in (("as called", op), ("plain", plain), ("exact", exact)):
        monkeypatch.setitem(FORMS, "mesa", Forms(fn, FORMS["mesa"].recurrent))  # the chunkwise form the mixer calls
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, _ = model(ids[:, :-1])
        nll[name] = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none").double()
    error = {name: (nll[name] - nll["exact"]).norm().item() for name in ("as called", "plain")}
    assert 0 < error["plain"] < 0.1 * nll["exact"].norm()
    assert error["as called"] <= 4 * error["plain"], error


# ----------------------------------------------------------------------------------------------------------------------
# robustness and dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_repeated_token_near_one_gates_stays_finite(dtype):
    """T=2048 starting with 500 copies of one key, beta = 0.999 and gamma = 0.9999: H_t grows to ~500 k k^T next to
    lam ~ 1, cond(A) ~ 1e3 at step 500; later steps decay it only slowly."""
    T, b, h, kd = 2048, 1, 2, 16
    x = realistic_inputs(T, kd, torch.float32, seed=5, b=b, h=h)
    x["k"][:, :500] = x["k"][:, :1]
    x["beta"] = torch.full((b, T, h), 0.999)
    x["log_gamma"] = torch.full((b, T, h), 0.9999).log()
    exact, _ = mesa(*(t.double() for t in x.values()), cg_steps=40)
    x = {n: (t.to(dtype) if n != "lam" else t).requires_grad_() for n, t in x.items()}
    out, (G, Hs), info = mesa(*x.values(), cg_steps=30, return_info=True)
    assert out.dtype == dtype and G.dtype == Hs.dtype == torch.float32
    assert torch.isfinite(out.float()).all() and torch.isfinite(G).all() and torch.isfinite(Hs).all()
    assert torch.isfinite(info["residual_max"])
    if dtype == torch.float32:  # measured 4e-6
        assert (out.double() - exact).norm() / exact.norm() < 1e-4
    (out.float().square().mean() + G.square().mean() + Hs.mean()).backward()
    for name, t in x.items():
        assert torch.isfinite(t.grad.float()).all(), name


def test_bfloat16_inputs_match_float32():
    x = realistic_inputs(T=100, Kd=16, seed=6)
    out32, (G32, H32) = mesa(*x.values(), chunk_size=32)
    x16 = {n: t.bfloat16() for n, t in x.items()}
    out, (G, Hs) = mesa(*x16.values(), chunk_size=32)
    rec, (G_rec, _) = mesa_recurrent(*x16.values())
    assert out.dtype == rec.dtype == torch.bfloat16 and G.dtype == Hs.dtype == torch.float32
    for a, b in ((out, out32), (rec, out32), (G, G32), (Hs, H32), (G_rec, G32)):
        err = (a.float() - b).norm() / b.norm()
        assert err < 3e-2, err


# ----------------------------------------------------------------------------------------------------------------------
# arguments and backends


def test_argument_checks():
    x = make_inputs(5, torch.float32)
    with pytest.raises(ValueError, match="lam"):
        mesa(*args(x)[:5], x["lam"][:, :2])
    with pytest.raises(ValueError, match="initial_state"):
        mesa(*args(x), initial_state=(x["G0"], x["H0"][..., :2]))
    with pytest.raises(ValueError, match="cg_steps"):
        mesa(*args(x), cg_steps=-1)
    with pytest.raises(ValueError, match="cg_tol"):
        mesa(*args(x), cg_tol=0.0)
    # "auto" is the torch code (on CPU, and on GPU too: see mesa's docstring)
    check_backends(lambda **kw: mesa(*args(x), **kw))


def test_fla_glue_with_a_fake_fla(monkeypatch):
    """The fla adapter (argument names, G stored transposed as h_kv, float32 gates and states, the returned tuple),
    run against a stand-in for fla.ops.mesa_net.chunk_mesa_net that follows the semantics of fla's source (its
    naive.py: h_kv += beta k v^T, o = h_kv^T x), since fla needs a GPU."""
    from lm.ops.fla_mesa import fla_mesa

    calls = []

    def chunk_mesa_net(q, k, v, g, beta, lamb, h_kk_init=None, h_kv_init=None, output_final_state=False,
                       max_CG_iteration=30, use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        assert g.dtype == beta.dtype == lamb.dtype == h_kk_init.dtype == h_kv_init.dtype == torch.float32
        assert h_kv_init.shape == (q.shape[0], q.shape[2], k.shape[-1], v.shape[-1]) and not use_qk_l2norm_in_kernel
        calls.append(max_CG_iteration)
        h_kk, h_kv = h_kk_init, h_kv_init
        outs = []
        for t in range(q.shape[1]):
            decay = g[:, t, :, None, None].exp()
            k_beta = k[:, t].float() * beta[:, t, :, None]
            h_kk = decay * h_kk + k_beta[..., :, None] * k[:, t, :, None, :].float()
            h_kv = decay * h_kv + k_beta[..., :, None] * v[:, t, :, None, :].float()
            x = torch.linalg.solve(h_kk + torch.diag_embed(lamb), q[:, t].float()[..., None])
            outs.append((h_kv.mT @ x)[..., 0])
        return torch.stack(outs, 1).to(q.dtype), h_kk, h_kv

    fake_module(monkeypatch, "fla.ops.mesa_net", chunk_mesa_net=chunk_mesa_net)
    x = make_inputs(20, torch.float32, shape=(B, H, K, K))
    out, (G, Hs) = fla_mesa(*args(x), 7, (x["G0"], x["H0"]))
    assert calls == [7]
    out_ref, (G_ref, H_ref) = chunkwise(x)
    assert G.shape == (B, H, K, K) and Hs.shape == (B, H, K, K)
    assert_close(out, out_ref, 1e-4)
    assert_close(G, G_ref, 1e-5)
    assert_close(Hs, H_ref, 1e-5)

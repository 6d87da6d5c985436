"""`reset` through the ops (packed documents): a packed row with resets computes what each document alone computes,
the first continuing the carried state, the others from the zero state; chunkwise and recurrent, token by token, with
gradients, in float64. The per-document runs use each op's recurrent form without resets, which the op's own tests
check against the math. (The mLSTM's resets are in tests/test_op_mlstm.py: its state carries a stabiliser.)"""

import pytest
import torch
import torch.nn.functional as F

from lm.ops import (
    delta_rule,
    delta_rule_recurrent,
    diagonal_scan,
    diagonal_scan_recurrent,
    kda,
    kda_recurrent,
    linear_attention,
    linear_attention_recurrent,
    mesa,
    mesa_recurrent,
    precond_delta_rule,
    precond_delta_rule_recurrent,
)

B, T, H, K, V, CHUNK = 2, 37, 2, 4, 3, 8
# Row 0: a reset at a chunk's last step (7, a one-token document) and first step (16, again one token), two in a
# row; row 1: a reset at step 0 (the carried state is dropped), at the last step of two chunks, and at the very end.
RESETS = [[5, 7, 16, 17, 30], [0, 15, 23, 36]]


def reset_mask(dtype=torch.bool):
    reset = torch.zeros(B, T, dtype=dtype)
    for row, steps in enumerate(RESETS):
        reset[row, steps] = True
    return reset


def documents(row: int) -> list[tuple[int, int]]:
    """(start, end) of each document of a row."""
    bounds = sorted({0, *RESETS[row], T})
    return list(zip(bounds[:-1], bounds[1:]))


def _inputs(op: str, seed: int = 0, dtype=torch.float64):
    """(positional args, keyword args, initial state) of one op, with [B, T, ...] inputs in realistic ranges."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    unit = lambda *shape: F.normalize(rand(*shape), dim=-1)  # noqa: E731
    decay = lambda *shape: F.logsigmoid(2.0 + rand(*shape))  # noqa: E731
    if op == "diagonal_scan":
        return [rand(B, T, 5), decay(B, T, 5)], {}, rand(B, 5)
    if op == "mesa":
        lam = 0.5 + torch.rand(H, K, generator=g, dtype=dtype)
        G0, M = rand(B, H, V, K), rand(B, H, K, K)
        return ([unit(B, T, H, K), unit(B, T, H, K), rand(B, T, H, V), decay(B, T, H),
                 torch.sigmoid(rand(B, T, H)), lam], {"cg_steps": 3 * K}, (G0, M @ M.mT))
    q, k, v, state = rand(B, T, H, K), unit(B, T, H, K), rand(B, T, H, V), rand(B, H, K, V)
    beta = torch.sigmoid(rand(B, T, H))
    if op == "linear_attention":
        return [q, k, v, decay(B, T, H), beta, 0.5], {}, state
    if op == "gla":
        return [q, k, v, decay(B, T, H, K), None, 0.5], {"sub_chunk": 4}, state
    if op == "deltanet":
        return [q, k, v, beta, None, 0.5], {}, state
    if op == "kda":  # a decay per key channel, beta in [0, 2]
        return [q, k, v, decay(B, T, H, K), 2 * beta, 0.5], {"sub_chunk": 4}, state
    if op == "precond_delta_rule":
        A = torch.rand(B, H, K, generator=g, dtype=dtype)
        return [q, k, v, 2 * beta, decay(B, T, H), torch.sigmoid(rand(B, T, H)), decay(B, T, H), 0.5], {}, (state, A)
    return [q, k, v, beta, decay(B, T, H), 0.5], {}, state  # gated_deltanet


FORMS = {
    "linear_attention": (linear_attention, linear_attention_recurrent),
    "gla": (linear_attention, linear_attention_recurrent),
    "deltanet": (delta_rule, delta_rule_recurrent),
    "gated_deltanet": (delta_rule, delta_rule_recurrent),
    "diagonal_scan": (diagonal_scan, diagonal_scan_recurrent),
    "mesa": (mesa, mesa_recurrent),
    "kda": (kda, kda_recurrent),
    "precond_delta_rule": (precond_delta_rule, precond_delta_rule_recurrent),
}
TOLERANCE = {"mesa": 1e-6}  # CG in float64: converged, not exact


def run(op, form, args, kwargs, state, reset=None):
    chunkwise, recurrent = FORMS[op]
    if form == "chunkwise":
        extra = {"chunk_size": CHUNK} if op == "diagonal_scan" else {"chunk_size": CHUNK, "backend": "torch"}
        return chunkwise(*args, **kwargs, **extra, initial_state=state, reset=reset)
    kwargs = {k: v for k, v in kwargs.items() if k != "sub_chunk"}
    return recurrent(*args, **kwargs, initial_state=state, reset=reset)


def time_slice(x, row, start, end):
    """Row `row`, steps [start, end) of a [B, T, ...] input; other inputs (scale, lam, None) as they are."""
    return x[row:row + 1, start:end] if torch.is_tensor(x) and x.dim() >= 2 and x.shape[:2] == (B, T) else x


def state_row(state, row, keep: bool):
    if isinstance(state, tuple):
        return tuple(state_row(s, row, keep) for s in state)
    return state[row:row + 1] if keep else torch.zeros_like(state[row:row + 1])


def each_document_alone(op, args, kwargs, state):
    """Outputs [B, T, ...] and final states of every row, each document run alone by the recurrent form without
    resets: the row's first document from the carried state (unless the row starts with a reset), the rest from 0."""
    outs, finals = [], []
    for row in range(B):
        pieces = []
        for start, end in documents(row):
            carried = start == 0 and 0 not in RESETS[row]
            out, final = run(op, "recurrent", [time_slice(a, row, start, end) for a in args], kwargs,
                             state_row(state, row, carried))
            pieces.append(out)
        outs.append(torch.cat(pieces, dim=1))
        finals.append(final)
    stack = lambda parts: torch.cat(parts) if torch.is_tensor(parts[0]) else tuple(map(torch.cat, zip(*parts)))  # noqa: E731
    return torch.cat(outs), stack(finals)


def flat(state):
    return torch.cat([s.flatten() for s in state]) if isinstance(state, tuple) else state.flatten()


@pytest.mark.parametrize("op", sorted(FORMS))
@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_packed_row_equals_each_document_alone(op, form):
    args, kwargs, state = _inputs(op)
    out, final = run(op, form, args, kwargs, state, reset_mask())
    want_out, want_final = each_document_alone(op, args, kwargs, state)
    tol = TOLERANCE.get(op, 1e-9)
    torch.testing.assert_close(out, want_out, rtol=0, atol=tol)
    torch.testing.assert_close(flat(final), flat(want_final), rtol=0, atol=tol)


@pytest.mark.parametrize("op", sorted(FORMS))
def test_gradients_of_a_packed_row_equal_each_document_alone(op):
    """d(a random projection of the outputs and final state) with respect to every input and the initial state."""
    args, kwargs, state = _inputs(op)
    leaves = [a for a in args if torch.is_tensor(a)] + list(state if isinstance(state, tuple) else (state,))
    for leaf in leaves:
        leaf.requires_grad_(True)
    g = torch.Generator().manual_seed(1)

    def grads(out, final):
        final = flat(final)
        w_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
        w_final = torch.randn(final.shape, generator=g, dtype=final.dtype)
        return torch.autograd.grad((out * w_out).sum() + (final * w_final).sum(), leaves, allow_unused=True)

    packed = grads(*run(op, "chunkwise", args, kwargs, state, reset_mask()))
    g.manual_seed(1)
    alone = grads(*each_document_alone(op, args, kwargs, state))
    tol = TOLERANCE.get(op, 1e-9)
    for got, want in zip(packed, alone):
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("op", sorted(FORMS))
def test_token_by_token_with_resets_equals_one_chunkwise_call(op):
    """Decoding: one token per call, the state carried and each token's reset given, as generation feeds them."""
    args, kwargs, state = _inputs(op)
    reset = reset_mask()
    want_out, want_final = run(op, "chunkwise", args, kwargs, state, reset)
    outs, carried = [], state
    for t in range(T):
        step = [a[:, t:t + 1] if torch.is_tensor(a) and a.dim() >= 2 and a.shape[:2] == (B, T) else a for a in args]
        out, carried = run(op, "recurrent", step, kwargs, carried, reset[:, t:t + 1])
        outs.append(out)
    tol = TOLERANCE.get(op, 1e-9)
    torch.testing.assert_close(torch.cat(outs, dim=1), want_out, rtol=0, atol=tol)
    torch.testing.assert_close(flat(carried), flat(want_final), rtol=0, atol=tol)


@pytest.mark.parametrize("op", sorted(FORMS))
def test_no_reset_and_an_all_false_reset_agree(op):
    args, kwargs, state = _inputs(op)
    without, final = run(op, "chunkwise", args, kwargs, state)
    with_false, final_false = run(op, "chunkwise", args, kwargs, state, torch.zeros(B, T, dtype=torch.bool))
    torch.testing.assert_close(with_false, without, rtol=0, atol=1e-12)
    torch.testing.assert_close(flat(final_false), flat(final), rtol=0, atol=1e-12)


@pytest.mark.parametrize("op", sorted(FORMS))
def test_float32_strong_decays_with_resets_stay_finite(op):
    """Decays down to exp(-60) per step next to resets: no log(0), no inf - inf, forward or backward."""
    args, kwargs, state = _inputs(op, dtype=torch.float32)
    args = [a * 30 if torch.is_tensor(a) and a.dtype == torch.float32 and bool((a <= 0).all()) and a.dim() >= 3
            else a for a in args]  # the log-decays, 30x stronger
    leaves = [a.requires_grad_(True) for a in args if torch.is_tensor(a) and a.dtype == torch.float32 and a.dim() >= 3]
    out, final = run(op, "chunkwise", args, kwargs, state, reset_mask())
    (grads) = torch.autograd.grad(out.sum() + flat(final).sum(), leaves)
    assert torch.isfinite(out).all() and torch.isfinite(flat(final)).all()
    assert all(torch.isfinite(gr).all() for gr in grads)


def test_reset_shape_is_checked():
    args, kwargs, state = _inputs("linear_attention")
    with pytest.raises(ValueError, match="reset"):
        run("linear_attention", "chunkwise", args, kwargs, state, torch.zeros(B, T + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="reset"):
        run("linear_attention", "chunkwise", args, kwargs, state, torch.zeros(B, T))


def test_fla_varlen_glue_with_a_fake_fla(monkeypatch):
    """Resets on the fla path: the batch flattened into one row with cu_seqlens, each row's first sequence from its
    initial state (none for a row that starts with a reset), the final state of each row's last sequence; run against
    a stand-in for fla.ops.simple_gla that follows fla's documented varlen semantics, since fla needs a GPU."""
    import sys
    import types

    from lm.ops.fla import fla_linear_attention

    def chunk_simple_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
        assert q.shape[0] == 1 and initial_state.shape[0] == len(cu_seqlens) - 1  # fla's varlen contract
        outs, finals = [], []
        for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            out, final = linear_attention_recurrent(q[:, start:end], k[:, start:end], v[:, start:end],
                                                    g[:, start:end], None, scale, initial_state=initial_state[n:n + 1])
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals)

    fake = types.ModuleType("fla.ops.simple_gla")
    fake.chunk_simple_gla = chunk_simple_gla
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", fake)
    (q, k, v, log_gamma, beta, scale), _, state = _inputs("linear_attention")
    out, final = fla_linear_attention(q, k, v, log_gamma, beta, scale, state, reset_mask())
    want_out, want_final = run("linear_attention", "chunkwise", [q, k, v, log_gamma, beta, scale], {}, state,
                               reset_mask())
    # fla's states are float32 (the glue passes them so): float32 rounding, not float64's
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(final, want_final.float(), rtol=0, atol=1e-5)

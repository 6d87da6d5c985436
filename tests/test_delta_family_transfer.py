"""Transfer maps of KDA, gated DeltaProduct and the preconditioned delta rule (context parallelism), in float64 against
each op run whole, as tests/test_state_transfer.py checks the other ops: 13 steps cut into pieces of 5, 4 and 4, each
piece's (final state from zero, map) computed from its own inputs, the entering states composed from those alone, each
piece run from its composed state. Outputs, final state and every input's gradient must be the whole call's, from
a carried initial state or none, with a document that starts on a piece boundary and one inside a piece. The
preconditioned rule's S map depends on the preconditioner state a piece enters with, so its A is composed first."""

import pytest
import torch
import torch.nn.functional as F

from lm.ops import delta_product, kda, precond_delta_rule
from lm.ops.delta_product import carry_delta_product, delta_product_transfer
from lm.ops.kda import carry_kda, kda_transfer
from lm.ops.precond_delta_rule import carry_precond, carry_precond_a, precond_a_transfer, precond_transfer

B, T, H, K, V, N_H = 2, 13, 2, 3, 4, 2
PIECES = [(0, 5), (5, 9), (9, 13)]
OPTIONS = {"chunk_size": 4, "backend": "torch"}


def inputs(name: str) -> dict[str, torch.Tensor]:
    """[B, T, ...] inputs (DeltaProduct's k, v, beta token-major, [B, T, n_h, ...], so that a piece is a slice)."""
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    rand = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    rows = (N_H,) if name == "delta_product" else ()
    x = {"q": randn(B, T, H, K), "k": F.normalize(randn(B, T, *rows, H, K), dim=-1), "v": randn(B, T, *rows, H, V)}
    if name == "kda":  # GDN-2's channel gates, b in [0, 2]
        x.update(log_alpha=F.logsigmoid(randn(B, T, H, K) + 2), erase=2 * rand(B, T, H, K), write=rand(B, T, H, V))
    else:
        x.update(beta=2 * rand(B, T, *rows, H), log_alpha=F.logsigmoid(randn(B, T, H) + 2))
    if name == "precond":
        x.update(beta_a=rand(B, T, H), log_alpha_a=F.logsigmoid(randn(B, T, H) + 2))
    return x


def initial_state(name: str):
    g = torch.Generator().manual_seed(1)
    S = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    return (S, torch.rand(B, H, K, generator=g, dtype=torch.float64)) if name == "precond" else S


def run(name, x, initial, reset):
    if name == "kda":
        return kda(x["q"], x["k"], x["v"], x["log_alpha"], None, K**-0.5, erase=x["erase"], write=x["write"],
                   initial_state=initial, reset=reset, sub_chunk=2, **OPTIONS)
    if name == "delta_product":
        k, v, beta = (x[n].flatten(1, 2) for n in ("k", "v", "beta"))
        return delta_product(x["q"], k, v, beta, x["log_alpha"], K**-0.5, initial_state=initial, reset=reset,
                             **OPTIONS)
    return precond_delta_rule(*precond_args(x), initial_state=initial, reset=reset, **OPTIONS)


def precond_args(x):
    return x["q"], x["k"], x["v"], x["beta"], x["log_alpha"], x["beta_a"], x["log_alpha_a"], K**-0.5


def final_and_transfer(name, x, reset, entering_A=None):
    """A piece's (final state from zero, transfer map), as a rank would compute them."""
    if name == "kda":
        return kda_transfer(x["q"], x["k"], x["v"], x["log_alpha"], None, K**-0.5, erase=x["erase"],
                            write=x["write"], reset=reset, sub_chunk=2, **OPTIONS)
    if name == "delta_product":
        k, v, beta = (x[n].flatten(1, 2) for n in ("k", "v", "beta"))
        return delta_product_transfer(x["q"], k, v, beta, x["log_alpha"], K**-0.5, reset=reset, **OPTIONS)
    return precond_transfer(*precond_args(x), initial_A=entering_A, reset=reset, **OPTIONS)


CARRY = {"kda": carry_kda, "delta_product": carry_delta_product, "precond": carry_precond}


def loss_of(out, final):
    g = torch.Generator().manual_seed(5)
    total = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    for tensor in (final if isinstance(final, tuple) else (final,)):
        total = total + (tensor * torch.randn(tensor.shape, generator=g, dtype=tensor.dtype)).sum()
    return total


@pytest.mark.parametrize("carried", [False, True], ids=["from_zero", "from_a_state"])
@pytest.mark.parametrize("with_reset", [False, True], ids=["no_reset", "resets"])
@pytest.mark.parametrize("name", sorted(CARRY))
def test_pieces_composed_from_their_maps_equal_the_whole_call(name, with_reset, carried):
    reset = None
    if with_reset:  # row 0: a document starts on the boundary at 5 and inside the last piece at 11
        reset = torch.zeros(B, T, dtype=torch.bool)
        reset[0, 5] = reset[0, 11] = True

    def leaves():
        x = {n: t.clone().requires_grad_() for n, t in inputs(name).items()}
        start = initial_state(name) if carried else None
        start = start if start is None else tuple(s.requires_grad_() for s in start) if name == "precond" \
            else start.requires_grad_()
        return x, start

    whole_x, whole_start = leaves()
    whole_out, whole_final = run(name, whole_x, whole_start, reset)
    loss_of(whole_out, whole_final).backward()

    x, start = leaves()
    piece_reset = lambda lo, hi: None if reset is None else reset[:, lo:hi]  # noqa: E731
    pieces = [{n: t[:, lo:hi] for n, t in x.items()} for lo, hi in PIECES]
    entering_A = [None] * len(PIECES)
    if name == "precond":  # first round: A's maps alone, composed into the A each piece really starts from
        A = None if start is None else start[1]
        for i, (piece, (lo, hi)) in enumerate(zip(pieces, PIECES)):
            entering_A[i] = A
            A_from_zero, log_map = precond_a_transfer(piece["k"], piece["beta_a"], piece["log_alpha_a"],
                                                      reset=piece_reset(lo, hi))
            A = carry_precond_a(A, log_map, A_from_zero)
    maps = [final_and_transfer(name, piece, piece_reset(lo, hi), entering_A[i])
            for i, (piece, (lo, hi)) in enumerate(zip(pieces, PIECES))]
    outs, entering = [], start
    for piece, (lo, hi), (final, transfer) in zip(pieces, PIECES, maps):
        out, _ = run(name, piece, entering, piece_reset(lo, hi))
        outs.append(out)
        entering = CARRY[name](entering, transfer, final)  # from the maps only, never from the run above
    out = torch.cat(outs, dim=1)
    loss_of(out, entering).backward()

    assert (out - whole_out).abs().max() < 1e-10
    for got, expected in zip(*(f if isinstance(f, tuple) else (f,) for f in (entering, whole_final)), strict=True):
        assert (got - expected).abs().max() < 1e-10
    for n in x:
        assert (x[n].grad - whole_x[n].grad).abs().max() < 1e-10, n
    if carried:
        for got, expected in zip(*(s if isinstance(s, tuple) else (s,) for s in (start, whole_start))):
            assert (got.grad - expected.grad).abs().max() < 1e-10


def test_the_preconditioned_map_depends_on_the_entering_preconditioner_state():
    """Why A is composed first: the S map of one piece differs with the A it starts from."""
    x = {n: t[:, :5] for n, t in inputs("precond").items()}
    _, (from_zero, _) = precond_transfer(*precond_args(x), **OPTIONS)
    _, (from_A, _) = precond_transfer(*precond_args(x), initial_A=initial_state("precond")[1], **OPTIONS)
    assert (from_zero - from_A).abs().max() > 1e-3

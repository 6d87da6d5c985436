"""Transfer maps (lm.ops.state_transfer), in float64 against each op run whole: a sequence of 13 steps cut into
pieces of 5, 4 and 4, each piece run from the zero state for (final state, map), the entering states composed from
those alone, and each piece then run from its composed state. The outputs, the final state and the gradients of
every input must be the whole call's, with a document that starts on a piece boundary and one inside a piece."""

import pytest
import torch
import torch.nn.functional as F

from lm.ops import delta_rule, diagonal_scan, linear_attention, mesa, mlstm
from lm.ops.state_transfer import (
    carry_decayed,
    carry_delta_rule,
    carry_mlstm,
    delta_rule_transfer,
    mlstm_transfer,
    piece_log_decay,
)

B, T, H, K, V = 2, 13, 2, 3, 4
PIECES = [(0, 5), (5, 9), (9, 13)]


def inputs(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    if name == "diagonal_scan":
        return {"x": randn(B, T, V), "log_a": F.logsigmoid(randn(B, T, V) + 2)}
    x = {"q": randn(B, T, H, K), "k": F.normalize(randn(B, T, H, K), dim=-1), "v": randn(B, T, H, V)}
    if name == "gla":
        x["log_gamma"] = F.logsigmoid(randn(B, T, H, K) + 2)
    elif name in ("linear_attention", "mesa"):
        x["log_gamma"], x["beta"] = F.logsigmoid(randn(B, T, H) + 2), torch.sigmoid(randn(B, T, H))
    elif name.endswith("delta_rule"):
        x["beta"] = torch.sigmoid(randn(B, T, H))
        if name == "gated_delta_rule":
            x["log_alpha"] = F.logsigmoid(randn(B, T, H) + 2)
    elif name == "mlstm":
        x["i_pre"], x["f_pre"] = randn(B, T, H) - 1, randn(B, T, H) + 3
    return x


LAM = torch.full((H, K), 0.5, dtype=torch.float64)


def run(name, x, initial, reset):
    """(out, final state) of the op on x from `initial`."""
    kw = {"initial_state": initial, "reset": reset, "chunk_size": 4}
    if name == "diagonal_scan":
        return diagonal_scan(x["x"], x["log_a"], **kw)
    if name == "gla":
        return linear_attention(x["q"], x["k"], x["v"], x["log_gamma"], None, K**-0.5, sub_chunk=2, **kw)
    if name == "linear_attention":
        return linear_attention(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], K**-0.5, **kw)
    if name.endswith("delta_rule"):
        return delta_rule(x["q"], x["k"], x["v"], x["beta"], x.get("log_alpha"), K**-0.5, **kw)
    if name == "mesa":
        return mesa(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], LAM, cg_steps=40, **kw)
    return mlstm(x["q"], x["k"], x["v"], x["i_pre"], x["f_pre"], eps=1e-6, **kw)


def final_and_transfer(name, x, reset):
    """A piece's (final state from zero, transfer map), as lm's mixers compute them for context parallelism."""
    if name.endswith("delta_rule"):
        return delta_rule_transfer(x["q"], x["k"], x["v"], x["beta"], x.get("log_alpha"), K**-0.5, reset=reset,
                                   chunk_size=4)
    if name == "mesa":  # G and H from zero need no solve
        _, final = mesa(x["q"], x["k"], x["v"], x["log_gamma"], x["beta"], LAM, cg_steps=0, reset=reset,
                        chunk_size=4)
    else:
        _, final = run(name, x, None, reset)
    if name == "mlstm":
        return final, mlstm_transfer(x["i_pre"], x["f_pre"], reset, final)
    return final, piece_log_decay(x["log_a" if name == "diagonal_scan" else "log_gamma"], reset)


def carry(name):
    return {"mlstm": carry_mlstm}.get(name, carry_delta_rule if name.endswith("delta_rule") else carry_decayed)


def loss_of(out, final):
    """A fixed random projection of the outputs and of every final state tensor."""
    g = torch.Generator().manual_seed(5)
    total = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    for tensor in (final if isinstance(final, tuple) else (final,)):
        if tensor.requires_grad:
            total = total + (tensor * torch.randn(tensor.shape, generator=g, dtype=tensor.dtype)).sum()
    return total


OPS = ["diagonal_scan", "gla", "linear_attention", "delta_rule", "gated_delta_rule", "mesa", "mlstm"]


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("with_reset", [False, True])
def test_pieces_composed_from_their_maps_equal_the_whole_call(name, with_reset):
    reset = None
    if with_reset:  # row 0: a document starts on the boundary at 5 and inside the last piece at 11
        reset = torch.zeros(B, T, dtype=torch.bool)
        reset[0, 5] = reset[0, 11] = True
    whole_x = {n: t.clone().requires_grad_() for n, t in inputs(name).items()}
    whole_out, whole_final = run(name, whole_x, None, reset)
    loss_of(whole_out, whole_final).backward()

    x = {n: t.clone().requires_grad_() for n, t in inputs(name).items()}
    maps = []
    for start, end in PIECES:
        piece = {n: t[:, start:end] for n, t in x.items()}
        maps.append(final_and_transfer(name, piece, None if reset is None else reset[:, start:end]))
    outs, entering = [], None
    for (start, end), (final, transfer) in zip(PIECES, maps):
        piece = {n: t[:, start:end] for n, t in x.items()}
        out, _ = run(name, piece, entering, None if reset is None else reset[:, start:end])
        outs.append(out)
        entering = carry(name)(entering, transfer, final)  # built from the maps only, never from the run above
    out = torch.cat(outs, dim=1)
    loss_of(out, entering).backward()

    assert (out - whole_out).abs().max() < 1e-10
    for got, expected in zip(*(f if isinstance(f, tuple) else (f,) for f in (entering, whole_final))):
        assert (got - expected).abs().max() < 1e-10
    for n in x:
        assert (x[n].grad - whole_x[n].grad).abs().max() < 1e-10, n


def test_a_reset_in_a_piece_makes_its_decay_map_zero():
    reset = torch.zeros(B, 4, dtype=torch.bool)
    reset[0, 2] = True
    log_decay = torch.full((B, 4, H), -0.1, dtype=torch.float64)
    assert piece_log_decay(log_decay, reset)[0].isneginf().all()
    assert torch.allclose(piece_log_decay(log_decay, reset)[1], torch.full((H,), -0.4, dtype=torch.float64))

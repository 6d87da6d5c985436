"""`reset` through every registered mixer and the model (packed documents, docs/design.md, "Mixer contract"): a packed
row with resets computes what each of its documents computes alone, the first continuing a carried state (recurrent
state, conv buffers, KV cache), in float64; in one call and token by token."""

import dataclasses

import pytest
import torch

from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig

D, HEADS, HEAD_DIM, B, T, CHUNK = 24, 3, 8, 2, 37, 8
# Row 0: resets at a chunk's last step (7: a one-token document) and first step (16, again one token), two in a row;
# row 1: a reset at step 0 (the carried state is dropped), at the last step of two chunks, and at the very end.
RESETS = [[5, 7, 16, 17, 30], [0, 15, 23, 36]]
# Options that add state a reset must clear (convs, a window), beside every mixer's defaults.
VARIANTS = [(name, {}) for name in sorted(MIXERS)] + [
    ("mlstm", {"conv_size": 4}), ("gla", {"conv_size": 4}), ("swa", {"window": 5}), ("mesa", {"conv_v": True})]


def build(name: str, **options):
    fields = {f.name for f in dataclasses.fields(MIXERS[name].Options)}
    if "chunk_size" in fields:  # chunks of 8, so that resets fall on chunk boundaries
        options = {"chunk_size": CHUNK, **({"sub_chunk": 4} if "sub_chunk" in fields else {}), **options}
    torch.manual_seed(0)
    return MIXERS[name](D, HEADS, HEAD_DIM, 0, **options).double()


def reset_mask():
    reset = torch.zeros(B, T, dtype=torch.bool)
    for row, steps in enumerate(RESETS):
        reset[row, steps] = True
    return reset


def documents(row: int) -> list[tuple[int, int]]:
    bounds = sorted({0, *RESETS[row], T})
    return list(zip(bounds[:-1], bounds[1:]))


def row_state(state, row: int):
    """One batch row of a mixer state (tensors [B, ...], nested in tuples, lists and dicts; ints as they are)."""
    if torch.is_tensor(state):
        return state[row:row + 1]
    if isinstance(state, dict):
        return {key: row_state(value, row) for key, value in state.items()}
    if isinstance(state, (tuple, list)):
        return type(state)(row_state(value, row) for value in state)
    return state


def each_document_alone(mixer, x, state):
    """[B, T, D]: every document of every row in its own call, the row's first one from the carried `state` (unless
    the row starts with a reset), the others from no state."""
    rows = []
    for row in range(B):
        pieces = []
        for start, end in documents(row):
            carried = row_state(state, row) if start == 0 and 0 not in RESETS[row] else None
            pieces.append(mixer(x[row:row + 1, start:end], carried)[0])
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


def carried_state(mixer):
    """The state after a 6-token prefix, so that the first document continues something."""
    return mixer(torch.randn(B, 6, D, dtype=torch.float64), None)[1]


@pytest.mark.parametrize("name, options", VARIANTS, ids=[f"{n}{o or ''}" for n, o in VARIANTS])
def test_packed_row_equals_each_document_alone(name, options):
    mixer = build(name, **options)
    state = carried_state(mixer)
    x = torch.randn(B, T, D, dtype=torch.float64)
    packed, _ = mixer(x, state, reset_mask())
    tol = 1e-6 if name == "mesa" else 1e-9  # Mesa's CG converges, it is not exact
    torch.testing.assert_close(packed, each_document_alone(mixer, x, state), rtol=0, atol=tol)


@pytest.mark.parametrize("name, options", VARIANTS, ids=[f"{n}{o or ''}" for n, o in VARIANTS])
def test_token_by_token_with_resets_equals_one_call(name, options):
    """Decoding: one token per call with the state carried and each token's reset; the final state then continues
    the last document as one call's does."""
    mixer = build(name, **options)
    state = carried_state(mixer)
    x = torch.randn(B, T + 3, D, dtype=torch.float64)
    reset = torch.cat([reset_mask(), torch.zeros(B, 3, dtype=torch.bool)], dim=1)
    whole, _ = mixer(x, state, reset)
    outs, carried = [], state
    for t in range(T + 3):
        y, carried = mixer(x[:, t:t + 1], carried, reset[:, t:t + 1])
        outs.append(y)
    tol = 1e-6 if name == "mesa" else 1e-9
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=0, atol=tol)


def test_a_reset_changes_what_follows_it():
    """The reset is not a no-op: without it, the documents after the first see the earlier ones."""
    mixer = build("gated_deltanet")
    x = torch.randn(B, T, D, dtype=torch.float64)
    assert not torch.allclose(mixer(x, None, reset_mask())[0], mixer(x)[0])


@pytest.mark.parametrize("layer_pattern", ["mesa,attention", "mamba2,swa", "hawk,gla", "mlstm,deltanet"])
def test_model_with_a_document_separator_resets_at_it(layer_pattern):
    """LanguageModel: with cfg.document_separator, a row of packed documents (each starting with the separator) gives
    the logits of each document alone; a model without it does not."""
    sep = 1
    cfg = LMConfig(vocab_size=32, d_model=D, n_layers=2, n_heads=HEADS, head_dim=HEAD_DIM, mixer="attention",
                   layer_pattern=layer_pattern, mixer_options={"swa": {"window": 5}}, document_separator=sep)
    torch.manual_seed(0)
    model = LanguageModel(cfg).double().eval()
    tokens = torch.randint(2, 32, (1, 30))
    for start in (0, 9, 10, 22):  # documents of 9, 1, 12 and 8 tokens
        tokens[0, start] = sep
    packed, _ = model(tokens)
    alone = torch.cat([model(tokens[:, s:e])[0] for s, e in [(0, 9), (9, 10), (10, 22), (22, 30)]], dim=1)
    tol = 1e-6 if "mesa" in layer_pattern else 1e-9
    torch.testing.assert_close(packed, alone, rtol=0, atol=tol)
    model.cfg.document_separator = None
    assert not torch.allclose(model(tokens)[0], alone, rtol=0, atol=1e-3)


@pytest.mark.parametrize("restart", [True, False])
def test_rope_positions_restart_at_each_document(monkeypatch, restart):
    """rope_restart (the default): rotary positions count from each document's start, in one call and in decoding
    (a document carried over from the cache keeps counting); off, they count through the row."""
    import lm.mixers.attention as attention

    seen = []
    original = attention.rotary_tables
    monkeypatch.setattr(attention, "rotary_tables", lambda pos, *a: seen.append(pos.expand(B, -1)) or original(pos, *a))
    mixer = build("attention", rope_restart=restart)
    x, reset = torch.randn(B, 12, D, dtype=torch.float64), torch.zeros(B, 12, dtype=torch.bool)
    reset[0, 4], reset[1, 0] = True, True
    _, state = mixer(x[:, :10], None, reset[:, :10])
    mixer(x[:, 10:], state, reset[:, 10:])
    positions = torch.cat(seen, dim=1)
    if restart:
        assert positions[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
        assert positions[1].tolist() == list(range(12))
    else:
        assert positions.tolist() == [list(range(12))] * 2

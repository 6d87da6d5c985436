"""The mixer contract (docs/design.md, "Mixer contract"): one call == the sequence split anywhere with the state carried
== one token at a time. Checked in float64 for every registered mixer."""

import pytest
import torch

from lm.mixers import MIXERS

D, HEADS, HEAD_DIM = 24, 3, 8


def build(name: str, **options):
    torch.manual_seed(0)
    return MIXERS[name](D, HEADS, HEAD_DIM, 0, **options).double()


def run_in_pieces(mixer, x, cuts):
    outputs, state, start = [], None, 0
    for end in list(cuts) + [x.shape[1]]:
        y, state = mixer(x[:, start:end], state)
        outputs.append(y)
        start = end
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("name", sorted(MIXERS))
@pytest.mark.parametrize("T", [1, 17, 40])
def test_split_and_token_by_token_equal_one_call(name, T):
    mixer = build(name)
    x = torch.randn(2, T, D, dtype=torch.float64)
    full, _ = mixer(x)
    assert full.shape == x.shape
    cuts = [c for c in (T // 3, T // 3 + 1, T - 2) if 0 < c < T]
    torch.testing.assert_close(run_in_pieces(mixer, x, sorted(set(cuts))), full, rtol=0, atol=1e-10)
    torch.testing.assert_close(run_in_pieces(mixer, x, range(1, T)), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("n_kv_heads", [1, 3])
def test_attention_grouped_query_heads_keep_the_contract(n_kv_heads):
    mixer = build("attention", n_kv_heads=n_kv_heads)
    x = torch.randn(2, 19, D, dtype=torch.float64)
    full, (k, v, seen, _) = mixer(x)
    assert k.shape == v.shape == (2, n_kv_heads, 19, HEAD_DIM)
    torch.testing.assert_close(run_in_pieces(mixer, x, range(1, 19)), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name, options", [("mlstm", {"conv_size": 4}), ("swa", {"window": 5}),
                                           ("gla", {"chunk_size": 8, "sub_chunk": 4, "conv_size": 4}),
                                           ("hawk", {"chunk_size": 4})])
def test_options_that_add_state_keep_the_contract(name, options):
    mixer = build(name, **options)
    x = torch.randn(2, 19, D, dtype=torch.float64)
    full, _ = mixer(x)
    torch.testing.assert_close(run_in_pieces(mixer, x, [5, 6]), full, rtol=0, atol=1e-10)
    torch.testing.assert_close(run_in_pieces(mixer, x, range(1, 19)), full, rtol=0, atol=1e-10)


def test_attention_is_causal():
    mixer = build("attention")
    x = torch.randn(1, 12, D, dtype=torch.float64)
    changed = x.clone()
    changed[:, 7:] += 1.0
    torch.testing.assert_close(mixer(changed)[0][:, :7], mixer(x)[0][:, :7])
    assert not torch.allclose(mixer(changed)[0][:, 7:], mixer(x)[0][:, 7:])


def test_attention_parameter_count_matches_docstring_formula():
    mixer = MIXERS["attention"](D, HEADS, HEAD_DIM, 0, n_kv_heads=1)
    assert sum(p.numel() for p in mixer.parameters()) == D * HEAD_DIM * (2 * HEADS + 2 * 1)


def test_attention_rejects_impossible_heads():
    with pytest.raises(ValueError):
        MIXERS["attention"](D, 3, HEAD_DIM, 0, n_kv_heads=2)


@pytest.mark.parametrize("window", [1, 5])
def test_sliding_window_attention_sees_its_window_and_caches_only_it(window):
    """Each output is full attention over the window ending at its token (RoPE is relative, so the same weights
    give the same scores there, up to the float32 rotary tables' rounding at other positions); decoding keeps
    window - 1 tokens of cache, however long the sequence."""
    swa, attention = build("swa", window=window), build("attention")  # the same seed: the same weights
    x = torch.randn(2, 23, D, dtype=torch.float64)
    full, _ = swa(x)
    for t in range(23):
        alone, _ = attention(x[:, max(0, t - window + 1): t + 1])
        torch.testing.assert_close(full[:, t], alone[:, -1], rtol=0, atol=1e-7)
    state = None
    for t in range(23):
        _, state = swa(x[:, t: t + 1], state)
        assert state[0].shape[2] == min(t + 1, window - 1) and state[2] == t + 1

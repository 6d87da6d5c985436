"""The backbone: shapes, tied head, soft cap, KV-cache decoding == full forward, generation controls."""

import pytest
import torch

from lm.model import LanguageModel, LMConfig, sample_next
from lm.util.errors import UserError


def tiny(**overrides) -> LanguageModel:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=2, head_dim=16, max_seq_len=64)
    return LanguageModel(LMConfig(**{**cfg, **overrides})).double().eval()


def test_forward_shapes_and_tied_head():
    model = tiny()
    logits, state = model(torch.randint(0, 97, (3, 11)))
    assert logits.shape == (3, 11, 97) and len(state) == 2
    assert model.head is None
    untied = tiny(tie_embeddings=False)
    assert untied.num_params() == model.num_params() + 97 * 32


def test_parameter_count_of_the_paper_145m_attention_model():
    cfg = LMConfig(vocab_size=50257, d_model=768, n_layers=14, n_heads=6, head_dim=128)
    with torch.device("meta"):
        model = LanguageModel(cfg)
    per_block = 4 * 768 * 768 + 9 * 768 * 768 + 2 * 768
    assert model.num_params() == 50257 * 768 + 14 * per_block + 768
    assert 140e6 < model.num_params() < 150e6  # the paper's "145M"


def test_logit_soft_cap_bounds_logits():
    model = tiny(logit_soft_cap=2.0)
    model.embed.weight.data *= 100
    logits, _ = model(torch.randint(0, 97, (1, 5)))
    assert logits.abs().max() <= 2.0
    assert logits.abs().max() > 1.9


def test_cached_decoding_and_split_prefill_equal_the_full_forward():
    model = tiny(mixer_options={"attention": {"n_kv_heads": 1}})
    ids = torch.randint(0, 97, (2, 23))
    full, _ = model(ids)
    prefix, state = model(ids[:, :9])
    middle, state = model(ids[:, 9:16], state)
    steps = [prefix, middle]
    for t in range(16, 23):
        logits, state = model(ids[:, t:t + 1], state)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


def test_greedy_generation_matches_argmax_of_full_forward():
    model = tiny()
    prompt = torch.randint(0, 97, (2, 5))
    out = model.generate(prompt, max_new_tokens=6, temperature=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    for t in range(5, 11):  # each generated token is the argmax given everything before it
        logits, _ = model(out[:, :t])
        assert torch.equal(out[:, t], logits[:, -1].argmax(-1))


def test_generation_stops_at_eos_and_respects_the_bound():
    model = tiny()
    prompt = torch.randint(0, 97, (1, 4))
    greedy = model.generate(prompt, max_new_tokens=3, temperature=0)
    eos = int(greedy[0, 5])  # the second generated token
    out = model.generate(prompt, max_new_tokens=50, temperature=0, eos_id=eos)
    assert out.shape[1] <= 4 + 50 and int(out[0, -1]) == eos
    assert out.shape[1] == 4 + 2 or int(greedy[0, 4]) == eos


def test_sampling_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    assert all(int(sample_next(logits, 1.0, 1, None, g)) == 1 for _ in range(20))  # top_k=1 is greedy
    assert all(int(sample_next(logits, 1.0, None, 0.01, g)) == 1 for _ in range(20))  # tiny top_p too
    kept = {int(sample_next(logits, 1.0, 2, None, g)) for _ in range(200)}
    assert kept == {1, 3}
    assert int(sample_next(logits, 0.0, None, None)) == 1


def test_layer_pattern_cycles_over_depth_and_unknown_mixers_are_user_errors():
    cfg = LMConfig(vocab_size=10, d_model=8, n_layers=5, n_heads=1, head_dim=8, layer_pattern="attention")
    assert cfg.layer_mixers() == ["attention"] * 5
    with pytest.raises(UserError, match="unknown mixer"):
        LMConfig(vocab_size=10, d_model=8, n_layers=2, n_heads=1, head_dim=8, mixer="transformerx")
    with pytest.raises(UserError, match="must be positive"):
        LMConfig(vocab_size=10, d_model=0, n_layers=2, n_heads=1, head_dim=8)


THREE_TO_ONE = "gated_deltanet,gated_deltanet,gated_deltanet,attention"


def test_a_pattern_is_refused_where_the_depth_would_cut_it_unless_the_config_cycles_it():
    """A 3:1 hybrid over 2 layers would be pure Gated DeltaNet: refused, in one line that names the pattern's layers,
    what the model would be, and both ways out. With cycle_pattern it is built as asked, and says so."""
    shape = dict(vocab_size=10, d_model=16, n_heads=1, head_dim=16, layer_pattern=THREE_TO_ONE)
    with pytest.raises(UserError) as refused:
        LMConfig(n_layers=2, **shape)
    message = str(refused.value)
    assert "\n" not in message
    for part in ("model.layer_pattern has 4 layers (gated_deltanet, gated_deltanet, gated_deltanet, attention)",
                 "model.n_layers 2", "would be gated_deltanet x2", "multiple of 4", "model.cycle_pattern true"):
        assert part in message, message
    for n_layers in (4, 8):  # whole patterns
        cfg = LMConfig(n_layers=n_layers, **shape)
        assert cfg.layer_mixers() == THREE_TO_ONE.split(",") * (n_layers // 4)
    assert LMConfig(n_layers=8, **shape).layer_summary() == "8 layers: gated_deltanet x6, attention x2"
    cut = LMConfig(n_layers=6, cycle_pattern=True, **shape)
    assert cut.layer_mixers() == ["gated_deltanet"] * 3 + ["attention", "gated_deltanet", "gated_deltanet"]
    assert cut.layer_summary() == "6 layers: gated_deltanet x5, attention x1 (cycled: the 4-layer pattern cut at 6)"
    assert len(LanguageModel(cut).blocks) == 6
    single = LMConfig(vocab_size=10, d_model=16, n_layers=3, n_heads=1, head_dim=16, mixer="mamba2")
    assert single.layer_summary() == "3 layers: mamba2 x3"


def test_a_depth_longer_than_the_pattern_that_it_does_not_divide_is_refused_too():
    """The other side of the check above: past one whole pattern, a depth that is no multiple of it cuts the last
    repetition (a 2:1 pattern over 4 layers: three Gated DeltaNet layers for one attention); refused unless the config
    cycles it. Whole multiples pass, and cycle_pattern lets any depth through, shorter than the pattern too."""
    pattern = ["gated_deltanet", "gated_deltanet", "attention"]
    shape = dict(vocab_size=10, d_model=16, n_heads=1, head_dim=16, layer_pattern=",".join(pattern))
    for n_layers in (4, 5, 7, 8):
        with pytest.raises(UserError, match=f"has 3 layers .* which do not tile model.n_layers {n_layers}:"):
            LMConfig(n_layers=n_layers, **shape)
    for n_layers in (3, 6, 9):
        assert LMConfig(n_layers=n_layers, **shape).layer_mixers() == pattern * (n_layers // 3)
    for n_layers in (2, 4, 5):
        assert len(LMConfig(n_layers=n_layers, cycle_pattern=True, **shape).layer_mixers()) == n_layers

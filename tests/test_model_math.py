"""The backbone against its equations (MesaNet paper, App. E), written out in float64: embedding; per block
x += mixer(RMSNorm(x)), x += W_down(silu(W_gate h) * W_up h) with h = RMSNorm(x); a final RMSNorm; the head (the
embedding, or its own matrix untied); cap * tanh(logits / cap). The mixers are used as they are (each is checked
against its own equations in tests/test_mixer_math.py); norms' weights are moved off 1 so a dropped one shows."""

import pytest
import torch
import torch.nn.functional as F

from lm.model import LanguageModel, LMConfig


def rms_norm(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def backbone(model: LanguageModel, tokens: torch.Tensor, reset: torch.Tensor | None) -> torch.Tensor:
    cfg = model.cfg
    x = model.embed.weight[tokens]
    for block in model.blocks:
        x = x + block.mixer(rms_norm(x, block.mixer_norm.weight, cfg.norm_eps), None, reset)[0]
        h = rms_norm(x, block.mlp_norm.weight, cfg.norm_eps)
        mlp = block.mlp
        x = x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    x = rms_norm(x, model.norm.weight, cfg.norm_eps)
    logits = x @ (model.embed.weight if cfg.tie_embeddings else model.head.weight).T
    cap = cfg.logit_soft_cap
    return cap * torch.tanh(logits / cap) if cap else logits


@pytest.mark.parametrize("tie, cap, separator", [(True, 30.0, None), (False, None, 1), (True, 2.0, 1)])
def test_logits_and_loss_equal_the_backbones_equations(tie, cap, separator):
    cfg = LMConfig(vocab_size=40, d_model=24, n_layers=2, n_heads=3, head_dim=8, layer_pattern="gated_deltanet,swa",
                   mlp_ratio=2.5, tie_embeddings=tie, logit_soft_cap=cap, norm_eps=1e-3, document_separator=separator,
                   mixer_options={"swa": {"window": 5}})
    torch.manual_seed(0)
    model = LanguageModel(cfg).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    tokens = torch.randint(0, 40, (2, 23))
    tokens[:, [0, 9]] = 1
    reset = None if separator is None else tokens == separator
    expected = backbone(model, tokens, reset)
    logits, _ = model(tokens)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    targets = torch.randint(0, 40, (2, 23))
    loss, _ = model(tokens, targets=targets)
    torch.testing.assert_close(loss, F.cross_entropy(expected.flatten(0, 1), targets.flatten()),
                               rtol=1e-9, atol=0)

"""Analytic FLOPs per token (a multiply-add counts 2) and parameter counts, per architecture.

Training FLOPs are 3x the forward (the backward costs twice the forward). The attention term uses the causal
average context (T + 1) / 2, and only attention layers pay it.
"""

from lm.model import LMConfig


def attention_forward_flops(cfg: LMConfig, seq_len: int, n_kv_heads: int | None = None, **_) -> float:
    """Projections q, k, v, out plus scores and weighted values over the causal context."""
    n_kv_heads = n_kv_heads or cfg.n_heads
    projections = 2 * cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * n_kv_heads)
    context = (seq_len + 1) / 2
    return projections + 2 * 2 * cfg.n_heads * cfg.head_dim * context


MIXER_FORWARD_FLOPS = {"attention": attention_forward_flops}


def forward_flops_per_token(cfg: LMConfig, seq_len: int) -> float:
    """Forward FLOPs per token of a model trained on sequences of seq_len."""
    mlp = 2 * 3 * cfg.d_model * cfg.mlp_hidden
    head = 2 * cfg.d_model * cfg.vocab_size
    mixers = sum(MIXER_FORWARD_FLOPS[name](cfg, seq_len, **cfg.mixer_options.get(name, {}))
                 for name in cfg.layer_mixers())
    return mixers + cfg.n_layers * mlp + head


def train_flops_per_token(cfg: LMConfig, seq_len: int) -> float:
    return 3 * forward_flops_per_token(cfg, seq_len)

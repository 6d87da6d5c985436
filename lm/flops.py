"""Analytic FLOPs per token (a multiply-add counts 2) and parameter counts, per architecture.

A layer's forward FLOPs are 2 x its mixer's matrix parameters (the projections, from each mixer's
`param_count`) plus its sequence op: the attention term over the causal average context (T + 1) / 2 for
attention layers only, and the chunkwise cost for the recurrent ones. Training FLOPs are 3x the forward
(the backward costs twice the forward), except Mesa's op, whose backward is one adjoint CG solve plus the
backward of two linear-attention readouts rather than twice its forward.
"""

from lm.mixers import MIXERS
from lm.model import LMConfig


def linear_attention_op_flops(chunk: int, k: int, v: int) -> float:
    """Per token and head, chunkwise: scores and values within the chunk (2C(K+V)), reading and updating the
    K x V state (4KV)."""
    return 2 * chunk * (k + v) + 4 * k * v


def delta_rule_op_flops(chunk: int, k: int, v: int) -> float:
    """linear attention's cost plus the UT transform: k k^T in the chunk, W = T k, U = T v, U - W S."""
    return linear_attention_op_flops(chunk, k, v) + 2 * chunk * k + 2 * chunk * (k + v) + 2 * k * v


def op_flops(name: str, cfg: LMConfig, seq_len: int, options: dict) -> float:
    """Forward FLOPs per token of one layer's sequence op, all heads."""
    h, hd, chunk = cfg.n_heads, cfg.head_dim, min(options.get("chunk_size", 64), seq_len)
    if name == "attention":
        return 2 * 2 * h * hd * (seq_len + 1) / 2
    if name == "mamba2":
        inner = round(options.get("expand", 2.0) * cfg.d_model)
        return h * linear_attention_op_flops(chunk, hd, inner // h)
    if name in ("deltanet", "gated_deltanet"):
        v = round(options.get("expand_v", 1.0 if name == "deltanet" else 2.0) * hd)
        return h * delta_rule_op_flops(chunk, hd, v)
    if name == "mesa":
        steps = options.get("cg_steps", 30)
        v = round(options.get("expand_v", 1.0) * hd)
        # CG: one matvec with H_t per step (+1 for the diagonal of the warm start), then the readout G_t x_t.
        return h * ((steps + 1) * linear_attention_op_flops(chunk, hd, hd) + linear_attention_op_flops(chunk, hd, v))
    if name == "mlstm":
        k = round(options.get("qk_dim_factor", 0.5) * cfg.d_model) // h
        v = round(options.get("v_dim_factor", 1.0) * cfg.d_model) // h
        return h * (linear_attention_op_flops(chunk, k, v + 1))  # +1: the normaliser n rides along with v
    raise KeyError(f"no FLOP formula for mixer {name!r}")


def op_train_flops(name: str, cfg: LMConfig, seq_len: int, options: dict) -> float:
    """Forward + backward FLOPs per token of one layer's sequence op."""
    forward = op_flops(name, cfg, seq_len, options)
    if name != "mesa" or options.get("cg_steps", 30) == 0:
        return 3 * forward
    h, hd, chunk = cfg.n_heads, cfg.head_dim, min(options.get("chunk_size", 64), seq_len)
    v = round(options.get("expand_v", 1.0) * hd)
    kk, kv = linear_attention_op_flops(chunk, hd, hd), linear_attention_op_flops(chunk, hd, v)
    adjoint = (options.get("cg_steps", 30) + 1) * kk
    surrogate = 3 * (kk + kv)  # H_t x and G_t x recomputed, then their backward
    return forward + h * adjoint + h * surrogate


def mixer_params(name: str, cfg: LMConfig) -> int:
    return MIXERS[name].param_count(cfg.d_model, cfg.n_heads, cfg.head_dim, **cfg.mixer_options.get(name, {}))


def param_count(cfg: LMConfig, embeddings: bool = True) -> int:
    """Parameters of the model, from the formulas (equal to sum(p.numel()); tested)."""
    d = cfg.d_model
    block = 3 * d * cfg.mlp_hidden + 2 * d
    total = sum(mixer_params(name, cfg) + block for name in cfg.layer_mixers()) + d
    head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
    return total + head + (cfg.vocab_size * d if embeddings else 0)


def forward_flops_per_token(cfg: LMConfig, seq_len: int) -> float:
    """Forward FLOPs per token of a model trained on sequences of seq_len."""
    mlp = 2 * 3 * cfg.d_model * cfg.mlp_hidden
    head = 2 * cfg.d_model * cfg.vocab_size
    mixers = sum(2 * mixer_params(name, cfg) + op_flops(name, cfg, seq_len, cfg.mixer_options.get(name, {}))
                 for name in cfg.layer_mixers())
    return mixers + cfg.n_layers * mlp + head


def train_flops_per_token(cfg: LMConfig, seq_len: int) -> float:
    """3x the forward for every matrix; each sequence op's own forward + backward."""
    ops = sum(op_flops(name, cfg, seq_len, cfg.mixer_options.get(name, {})) for name in cfg.layer_mixers())
    ops_train = sum(op_train_flops(name, cfg, seq_len, cfg.mixer_options.get(name, {}))
                    for name in cfg.layer_mixers())
    return 3 * (forward_flops_per_token(cfg, seq_len) - ops) + ops_train

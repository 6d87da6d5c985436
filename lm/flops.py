"""Analytic FLOPs per token (a multiply-add counts 2) and parameter counts, per architecture. Used for MFU.

What is counted: matrix products (linear layers, einsum contractions, batched matmuls, the short convolutions) and
triangular solves, with the shapes the pure-torch path (lm.ops, backend="torch") uses: the chunkwise ops work on T
padded up to a multiple of the chunk, and their intra-chunk products are full C x C blocks (masked afterwards).
Elementwise work and reductions are not counted, as is usual for MFU: norms, activations, gates, softmax, decays,
the chunk scan's state decay, the mLSTM normaliser's sums and CG's dot products and vector updates (about 12K per
CG step, token and head: ~2% of a step at K = 128, C = 64).

A layer's forward is 2 x its mixer's parameters (each mixer's `param_count`: projections and convolutions; the few
vector parameters, such as norm gains, gate biases and decay rates, stand in for elementwise work of about that size)
plus its sequence op: for attention the causal average context (T + 1) / 2, what a causal kernel that skips masked
blocks does (only attention layers have a T-term); for the recurrent mixers the chunkwise op below. Training is 3x
the forward for every matrix product (the backward computes two products of the same size per product), except:
- the delta rule's triangular solve, whose backward is one more solve plus a full C x C x (K + V) product, and its
  sequential pass, two of whose state products need no gradient (`delta_rule_op_train_flops`);
- Mesa, whose backward is not the forward's (implicit differentiation: lm/ops/mesa.py), counted step by step below;
- products whose result no loss reads (Mesa's final key state with cg_steps = 0) have no backward.

tests/test_flops.py checks all this against torch.utils.flop_counter.FlopCounterMode on CPU in float32: the ops and
the MLP agree exactly, mixers and whole models to < 1% (the vector parameters). Real gaps, which the test bridges by
stated rules: the counter counts attention's full T x T products whatever the causal mask (and sees nothing of
PyTorch's CPU flash kernel, so the test runs the math backend); it has no formula for `linalg_solve_triangular`; its
convolution backward ignores groups (it counts a depthwise conv's weight gradient channels times too large); and it
counts no elementwise work. The fla / mlstm_kernels GPU kernels compute in other orders (e.g. an explicit inverse of
the UT matrix), within a few percent of these counts. With cg_tol, Mesa's CG may stop early: cg_steps is the most.
"""

import math

from lm.mixers import MIXERS
from lm.model import LMConfig
from lm.ops.common import effective_chunk_size


def padding_factor(seq_len: int, chunk: int) -> float:
    """Tokens a chunkwise op computes per real token: T padded up to a multiple of the chunk, over T."""
    return math.ceil(seq_len / chunk) * chunk / seq_len


def linear_attention_op_flops(chunk: int, k: int, v: int) -> float:
    """Per (padded) token and head: scores q k^T and scores @ v within the chunk (2C(K + V)), the chunk's write
    k^T v to the state and the read of the entering state by q (4KV)."""
    return 2 * chunk * (k + v) + 4 * k * v


def delta_rule_op_flops(chunk: int, k: int, v: int) -> float:
    """Per (padded) token and head: k k^T (2CK), the unit-triangular solve for [W | U~] with K + V right-hand sides
    ((C - 1)(K + V)), q k^T and scores @ u (2C(K + V)), and three K x V products with the state: W S, the write
    k^T u and the read q S (6KV)."""
    return 2 * chunk * k + (chunk - 1) * (k + v) + 2 * chunk * (k + v) + 6 * k * v


def delta_rule_op_train_flops(chunk: int, k: int, v: int, n_chunks: int) -> float:
    """3x the forward, except (1) the solve: its backward is one more solve and the full C x C x (K + V) product for
    the gradient of the triangular matrix, 2 (C - 1)(K + V) + 2C(K + V) instead of 2 (C - 1)(K + V); and (2) the
    per-chunk state products of the sequential pass that need no gradient: the first chunk's W S has none for the
    zero initial state (2CKV) and the last chunk's write k^T u feeds only the final state, which no loss reads
    (4CKV), i.e. 6KV / n_chunks per padded token."""
    return 3 * delta_rule_op_flops(chunk, k, v) + (chunk + 1) * (k + v) - 6 * k * v / n_chunks


def mlstm_op_flops(chunk: int, k: int, v: int) -> float:
    """Linear attention's products plus the normaliser's read n^T q (2K); its write and the row sums of the
    gated scores are reductions, not counted."""
    return linear_attention_op_flops(chunk, k, v) + 2 * k


def _mesa_parts(chunk: int, k: int, v: int) -> tuple[float, float, float]:
    """Per (padded) token and head: the key-state set-up (each chunk's k^T k, 2K^2, and diag(H_t) by the decay
    weights times k^2, 2CK), one CG matvec H_t p_t (p k^T and its product with k, 4CK, and the entering state, 2K^2:
    the state is computed once per solve) and the readout G_t x_t (linear attention)."""
    return 2 * k * k + 2 * chunk * k, 4 * chunk * k + 2 * k * k, linear_attention_op_flops(chunk, k, v)


def mesa_op_flops(chunk: int, k: int, v: int, cg_steps: int) -> float:
    """Per (padded) token and head: the key state, cg_steps + 2 matvecs (one for the starting residual, one for the
    true residual that the Mesa mixer's telemetry asks for) and the readout. cg_steps = 0 is the readout alone (plus
    H_T, 2K^2 per real token, added by `op_flops`)."""
    if cg_steps == 0:
        return linear_attention_op_flops(chunk, k, v)
    setup, matvec, readout = _mesa_parts(chunk, k, v)
    return setup + (cg_steps + 2) * matvec + readout


def mesa_op_train_flops(chunk: int, k: int, v: int, cg_steps: int) -> float:
    """Forward + backward per (padded) token and head. The backward (lm/ops/mesa.py) is the right-hand side G_t^T do_t
    (a linear attention), the key state again and the adjoint CG solve, then the surrogate: the readouts G_t x and
    H_t x recomputed and differentiated with x held constant, which skips the query gradient of q k^T (2CK each).
    The adjoint solve measures its true residual too."""
    if cg_steps == 0:
        return 3 * mesa_op_flops(chunk, k, v, 0)
    setup, matvec, readout = _mesa_parts(chunk, k, v)
    solve = setup + (cg_steps + 2) * matvec
    key_readout = linear_attention_op_flops(chunk, k, k)
    surrogate = 3 * (readout + key_readout) - 2 * (2 * chunk * k)
    return mesa_op_flops(chunk, k, v, cg_steps) + readout + solve + surrogate


def _op_shape(name: str, cfg: LMConfig, options: dict) -> tuple[int, int]:
    """(K, V) per head of a recurrent mixer's op, as the mixer builds it."""
    h, hd = cfg.n_heads, cfg.head_dim
    if name == "mamba2":
        return hd, int(round(options.get("expand", 2.0) * cfg.d_model)) // h
    if name in ("deltanet", "gated_deltanet"):
        return hd, int(round(options.get("expand_v", 1.0 if name == "deltanet" else 2.0) * hd))
    if name == "mesa":
        return hd, int(round(options.get("expand_v", 1.0) * hd))
    if name == "mlstm":
        return (int(round(options.get("qk_dim_factor", 0.5) * cfg.d_model)) // h,
                int(round(options.get("v_dim_factor", 1.0) * cfg.d_model)) // h)
    raise KeyError(f"no FLOP formula for mixer {name!r}")


def _op_flops(name: str, cfg: LMConfig, seq_len: int, options: dict, train: bool) -> float:
    """Forward (or forward + backward) FLOPs per token of one layer's sequence op, all heads."""
    h = cfg.n_heads
    if name == "attention":
        return (3 if train else 1) * 2 * 2 * h * cfg.head_dim * (seq_len + 1) / 2
    k, v = _op_shape(name, cfg, options)
    chunk = effective_chunk_size(options.get("chunk_size", 64), seq_len)
    pad = padding_factor(seq_len, chunk)
    if name == "mamba2":
        return (3 if train else 1) * h * pad * linear_attention_op_flops(chunk, k, v)
    if name in ("deltanet", "gated_deltanet"):
        if train:
            return h * pad * delta_rule_op_train_flops(chunk, k, v, math.ceil(seq_len / chunk))
        return h * pad * delta_rule_op_flops(chunk, k, v)
    if name == "mlstm":
        return (3 if train else 1) * h * pad * mlstm_op_flops(chunk, k, v)
    steps = options.get("cg_steps", 30)
    per_head = pad * (mesa_op_train_flops if train else mesa_op_flops)(chunk, k, v, steps)
    if steps == 0:
        per_head += 2 * k * k  # H_T is still carried: one product over all tokens, with no backward (no loss reads it)
    return h * per_head


def op_flops(name: str, cfg: LMConfig, seq_len: int, options: dict) -> float:
    """Forward FLOPs per token of one layer's sequence op, all heads."""
    return _op_flops(name, cfg, seq_len, options, train=False)


def op_train_flops(name: str, cfg: LMConfig, seq_len: int, options: dict) -> float:
    """Forward + backward FLOPs per token of one layer's sequence op, all heads."""
    return _op_flops(name, cfg, seq_len, options, train=True)


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
    """Forward FLOPs per token of a model trained on sequences of seq_len: mixers, SwiGLU MLPs (three matrices) and
    the output head (the embedding lookup is no product)."""
    mlp = 2 * 3 * cfg.d_model * cfg.mlp_hidden
    head = 2 * cfg.d_model * cfg.vocab_size
    mixers = sum(2 * mixer_params(name, cfg) + op_flops(name, cfg, seq_len, cfg.mixer_options.get(name, {}))
                 for name in cfg.layer_mixers())
    return mixers + cfg.n_layers * mlp + head


def train_flops_per_token(cfg: LMConfig, seq_len: int) -> float:
    """3x the forward for every matrix; each sequence op's own forward + backward. Activation checkpointing's
    recomputation is not counted (model FLOPs, not hardware FLOPs)."""
    ops = sum(op_flops(name, cfg, seq_len, cfg.mixer_options.get(name, {})) for name in cfg.layer_mixers())
    ops_train = sum(op_train_flops(name, cfg, seq_len, cfg.mixer_options.get(name, {}))
                    for name in cfg.layer_mixers())
    return 3 * (forward_flops_per_token(cfg, seq_len) - ops) + ops_train

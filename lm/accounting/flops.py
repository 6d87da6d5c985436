"""Analytic FLOPs per token (a multiply-add counts 2) and parameter counts, per architecture. Used for MFU.

What is counted: matrix products (linear layers, einsum contractions, batched matmuls, the short convolutions) and
triangular solves, with the shapes the pure-torch path (lm.ops, backend="torch") uses: the chunkwise ops work on T
padded up to a multiple of the chunk, and their intra-chunk products are full C x C blocks (masked afterwards).
Elementwise work and reductions are not counted, as is usual for MFU: norms, activations, gates, softmax, decays,
the chunk scan's state decay, the mLSTM normaliser's sums and CG's dot products and vector updates (about 12K per
CG step, token and head: ~2% of a step at K = 128, C = 64).

A layer's forward is 2 x its mixer's parameters (each mixer's `param_count`, counted on a build on the meta device:
projections and convolutions; the few vector parameters, such as norm gains, gate biases and decay rates, stand in for
elementwise work of about that size) plus its sequence op, as the mixer's own file counts it (`flops_per_token`,
`op_flops_per_token`): for attention the causal average context (T + 1) / 2, what a causal kernel that skips masked
blocks does (sliding-window attention's window caps it; only attention layers have a T-term); for the recurrent mixers
their op call's chunkwise form (lm/ops/flops.py's COSTS, by the op's name).
Training is 3x the forward for every matrix product (the backward computes two products of the same size per
product), except:
- the delta rule's triangular solve, whose backward is one more solve plus a full C x C x (K + V) product, and its
  sequential pass, two of whose state products need no gradient (`delta_rule_op_train_flops`);
- Mesa, whose backward is not the forward's (implicit differentiation: lm/ops/mesa.py), counted step by step;
- products whose result no loss reads (Mesa's final key state with cg_steps = 0) have no backward.

tests/test_flops.py checks all this against torch.utils.flop_counter.FlopCounterMode on CPU in float32: the ops and
the MLP agree exactly, mixers and whole models to < 1% (the vector parameters). Real gaps, which the test bridges by
stated rules: the counter counts attention's full T x T products whatever the causal mask (and sees nothing of
PyTorch's CPU flash kernel, so the test runs the math backend); it has no formula for `linalg_solve_triangular`; its
convolution backward ignores groups (it counts a depthwise conv's weight gradient channels times too large); and it
counts no elementwise work. The fla / mlstm_kernels GPU kernels compute in other orders (e.g. an explicit inverse of
the UT matrix), within a few percent of these counts.

As spent: with cg_tol, Mesa's CG stops early, so what a run spent depends on its data. `flops_spent_per_token` counts
a model's last call from its mixers' telemetry (each mixer's `flops_spent_per_token`: Mesa's CG steps as run, forward
and adjoint, each loop charged until its last token converged); training logs it (lm.training.callbacks.spent_flops)
and MFU, `lm compare report` and the ladder's L(C) use it. The analytic functions above charge cg_steps, the most;
plans estimate a tolerance run with `lm.ops.flops.expected_cg_steps` and say so.
"""

from lm.mixers import MIXERS
from lm.model import LMConfig


def _mixer(name: str, cfg: LMConfig) -> tuple[type, tuple, dict]:
    return MIXERS[name], (cfg.d_model, cfg.n_heads, cfg.head_dim), cfg.mixer_options.get(name, {})


def mixer_flops(name: str, cfg: LMConfig, seq_len: int, training: bool = False) -> float:
    """FLOPs per token of one layer's mixer (projections and sequence op), forward or forward + backward."""
    cls, shape, options = _mixer(name, cfg)
    return cls.flops_per_token(*shape, seq_len, training, **options)


def op_flops(name: str, cfg: LMConfig, seq_len: int, training: bool = False) -> float:
    """FLOPs per token of one layer's sequence op alone, all heads, forward or forward + backward."""
    cls, shape, options = _mixer(name, cfg)
    return cls.op_flops_per_token(*shape, seq_len, training, **options)


def mixer_params(name: str, cfg: LMConfig) -> int:
    cls, shape, options = _mixer(name, cfg)
    return cls.param_count(*shape, **options)


def param_count(cfg: LMConfig, embeddings: bool = True) -> int:
    """Parameters of the model: each layer's mixer (its `param_count`) plus the backbone's formula (equal to
    sum(p.numel()); tested)."""
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
    mixers = sum(mixer_flops(name, cfg, seq_len) for name in cfg.layer_mixers())
    return mixers + cfg.n_layers * mlp + head


def train_flops_per_token(cfg: LMConfig, seq_len: int) -> float:
    """3x the forward for every matrix; each mixer's own forward + backward (its sequence op's backward is not always
    2x its forward). Activation checkpointing's recomputation is not counted (model FLOPs, not hardware FLOPs)."""
    mixers = cfg.layer_mixers()
    mlp_and_head = forward_flops_per_token(cfg, seq_len) - sum(mixer_flops(name, cfg, seq_len) for name in mixers)
    return 3 * mlp_and_head + sum(mixer_flops(name, cfg, seq_len, training=True) for name in mixers)


def flops_notes(cfg: LMConfig) -> list[str]:
    """What the model's FLOP count assumes beyond its shape (each mixer's `flops_note`: Mesa's expected CG steps with
    cg_tol), once per mixer."""
    notes = (MIXERS[name].flops_note(cfg.d_model, cfg.n_heads, cfg.head_dim, **cfg.mixer_options.get(name, {}))
             for name in dict.fromkeys(cfg.layer_mixers()))
    return [note for note in notes if note]


def flops_spent_per_token(model, seq_len: int, training: bool) -> float:
    """FLOPs per token of `model`'s last call as it ran (a LanguageModel; training: with its backward): the MLPs and
    head as counted above, and each layer's mixer as it spent them (`Mixer.flops_spent_per_token`). Equal to
    train_flops_per_token (forward_flops_per_token) unless a mixer's work depends on the data."""
    cfg, mixers = model.cfg, [block.mixer for block in model.blocks]
    total = train_flops_per_token(cfg, seq_len) if training else forward_flops_per_token(cfg, seq_len)
    for name, mixer in zip(cfg.layer_mixers(), mixers, strict=True):
        total += mixer.flops_spent_per_token(seq_len, training) - mixer_flops(name, cfg, seq_len, training)
    return total

"""Sequence mixers: each is built as ``cls(d_model, n_heads, head_dim, layer_idx, **options)`` and has
``forward(x [B, T, D], state=None) -> (y [B, T, D], new_state)``; feeding a sequence in pieces with the state
carried gives the same output as one call. ``MIXERS`` maps a config name to its class."""

from lm.mixers.attention import Attention

MIXERS: dict[str, type] = {
    "attention": Attention,
}

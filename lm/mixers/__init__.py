"""Sequence mixers: each is built as ``cls(d_model, n_heads, head_dim, layer_idx, **options)`` and has
``forward(x [B, T, D], state=None) -> (y [B, T, D], new_state)``; feeding a sequence in pieces with the state
carried gives the same output as one call. ``MIXERS`` maps a config name to its class; each class has a
``param_count(d_model, n_heads, head_dim, **options)`` that its docstring spells out."""

from lm.mixers.attention import Attention
from lm.mixers.deltanet import DeltaNet, GatedDeltaNet
from lm.mixers.mamba2 import Mamba2
from lm.mixers.mesa import Mesa
from lm.mixers.mlstm import MLSTM

MIXERS: dict[str, type] = {
    "attention": Attention,
    "mamba2": Mamba2,
    "mlstm": MLSTM,
    "deltanet": DeltaNet,
    "gated_deltanet": GatedDeltaNet,
    "mesa": Mesa,
}

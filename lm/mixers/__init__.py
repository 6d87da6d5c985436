"""Sequence mixers, one file each (the protocol: lm.mixers.protocol). ``MIXERS`` maps a config name to its class;
importing this package registers every mixer in it (in the order of these imports)."""

from lm.mixers.attention import Attention
from lm.mixers.deltanet import DeltaNet, GatedDeltaNet
from lm.mixers.deltaproduct import GatedDeltaProduct
from lm.mixers.gla import GLA
from lm.mixers.hawk import Hawk
from lm.mixers.kda import KDA
from lm.mixers.mamba2 import Mamba2
from lm.mixers.mesa import Mesa
from lm.mixers.mlstm import MLSTM
from lm.mixers.precond_deltanet import PrecondGatedDeltaNet
from lm.mixers.protocol import MIXERS, Mixer, MixerOptionError, register
from lm.mixers.swa import SlidingWindowAttention

__all__ = ["GLA", "KDA", "MIXERS", "MLSTM", "Attention", "DeltaNet", "GatedDeltaNet", "GatedDeltaProduct", "Hawk",
           "Mamba2", "Mesa", "Mixer", "MixerOptionError", "PrecondGatedDeltaNet", "SlidingWindowAttention",
           "register"]

"""Sliding-window attention (the MesaNet paper's SWA-1024): softmax attention with RoPE in which each token sees
itself and the window - 1 tokens before it. Its KV cache keeps window - 1 tokens, so decoding memory is constant."""

from dataclasses import dataclass

from lm.mixers.attention import Attention
from lm.mixers.protocol import MixerOptionError, register


@register("swa")
class SlidingWindowAttention(Attention):
    """Attention (lm.mixers.attention) with a banded causal mask of `window` keys per query. With the default
    kernel "auto", the band goes to FlexAttention on CUDA, which computes only the key blocks within it (T x window),
    and to scaled_dot_product_attention as a dense mask on the CPU and when decoding; the `kernel` option forces
    either. Parameters: attention's."""

    @dataclass
    class Options(Attention.Options):
        """Sliding-window attention: attention in which each token sees itself and the window - 1 tokens before it.

        Attributes:
            window (tokens): keys each query sees, itself included (lm compare plan and the probes: half the training
                length where a config leaves it unset)
        """

        window: int = 1024

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        if self.options.window < 1:
            raise MixerOptionError(f"swa window must be at least 1, got {self.options.window}")
        self.window = self.options.window

    @classmethod
    def length_options(cls, seq_len: int) -> dict:
        return {"window": max(1, seq_len // 2)}

    @classmethod
    def mean_context(cls, seq_len: int, **options) -> float:
        """Keys per query averaged over the sequence: t for the first `window` queries, `window` after them."""
        w, T = cls.check_options(options).window, seq_len
        if T <= w:
            return (T + 1) / 2
        return (w * (w + 1) / 2 + (T - w) * w) / T

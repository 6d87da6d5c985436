"""Causal softmax attention with rotary position embeddings, grouped-query heads and a KV cache; and its sliding-window
form (SWA), whose cache holds the last window - 1 tokens only."""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.context_parallel import gather_pieces
from lm.mixers.flex_masks import attention_block_mask, flex_attend
from lm.mixers.layers import decay_group, residual_output, steps_since_reset
from lm.mixers.protocol import Mixer, MixerOptionError, register


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple:
    """cos and sin [1 or B, T, 1, head_dim / 2] of the angles position * theta^(-2i/head_dim), shared by q and k;
    positions [T], or [B, T] where each row counts from its own documents' starts."""
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * freqs  # [(B,) T, d/2]
    angles = angles if angles.dim() == 3 else angles[None]
    return angles.cos()[:, :, None, :].to(dtype), angles.sin()[:, :, None, :].to(dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + d/2]) of x [B, T, H, d] by the angles whose cos and sin are given."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_after_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
    """SDPA of T queries that follow cached keys: every cached key and the causal part of the T new ones (a
    lower-right causal mask), without a [T, keys] mask, which autograd would keep (a context-parallel piece against
    the pieces before it). On CUDA torch's CausalBias (its flash and memory-efficient kernels); elsewhere the queries
    padded in front to the keys' length through SDPA's causal kernel, the padded rows dropped: more compute than the T
    rows need, memory linear in the keys, so the CPU takes it only when autograd would keep the mask (training); a
    forward without gradients (evaluation in chunks) keeps the masked kernel."""
    T, L = q.shape[2], k.shape[2]
    if q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, L), enable_gqa=gqa)
    padded = torch.cat([q.new_zeros(*q.shape[:2], L - T, q.shape[3]), q], dim=2)
    return F.scaled_dot_product_attention(padded, k, v, is_causal=True, enable_gqa=gqa)[:, :, L - T:]


@register("attention")
class Attention(Mixer):
    """Multi-head causal attention (RoPE on q and k, optional grouped-query heads).

    The state is ``(k, v, seen, start)``: the KV cache, each [B, n_kv_heads, T_cached, head_dim], the number of
    tokens seen so far, and where each row's current document started ([B], or None before any reset); a call with a
    state attends to the cached tokens and to its own tokens causally, at positions that continue after them.

    With `reset` [B, T] (packed documents), a query sees only keys of its own document (a block-diagonal causal mask;
    cached keys of an earlier document are masked too), and with rope_restart (the default) its rotary position counts
    from its document's start. RoPE scores depend on position differences only, so the restart changes rounding, not
    the math: a document sees what it would see alone either way.

    The `kernel` option picks what computes the masked softmax. "sdpa": F.scaled_dot_product_attention, with
    is_causal for the causal mask and a dense [T, keys] (with documents [B, 1, T, keys]) boolean mask otherwise.
    "flex": FlexAttention (lm.mixers.flex_masks), which takes the same mask as a mask_mod and skips the key blocks it
    masks whole, so a window costs T x window rather than T^2 and documents cost no dense mask; it covers the KV cache
    too. "auto" (the default; the method `kernel` says why): FlexAttention on CUDA for a call without a cache whose
    mask is more than causal, SDPA otherwise.

    Parameters: d_model * head_dim * (2 * n_heads + 2 * n_kv_heads) (q, k, v, out projections, no biases).
    """

    @dataclass
    class Options:
        """Causal softmax attention with rotary position embeddings, grouped-query heads and a KV cache.

        Attributes:
            n_kv_heads: key and value heads, shared by groups of query heads (n_heads a multiple of it); null: n_heads
            rope_theta: RoPE's base, the angles position * rope_theta^(-2i / head_dim)
            rope_restart: with document resets, rotary positions count from each document's start
            kernel: what computes the masked softmax: auto (FlexAttention on CUDA where the mask is more than causal,
                else SDPA), sdpa or flex
        """

        n_kv_heads: int | None = None
        rope_theta: float = 10000.0
        rope_restart: bool = True
        kernel: Literal["auto", "sdpa", "flex"] = "auto"

    window: int | None = None  # keys each query sees, itself included (None: all before it)

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        n_kv_heads = self.options.n_kv_heads or n_heads
        if n_heads % n_kv_heads:
            raise MixerOptionError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if head_dim % 2:
            raise MixerOptionError(f"head_dim ({head_dim}) must be even for rotary embeddings")
        self.n_kv_heads, self.rope_theta = n_kv_heads, self.options.rope_theta
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.out_proj = residual_output(nn.Linear(n_heads * head_dim, d_model, bias=False))
        decay_group("qk", self.q_proj.weight, self.k_proj.weight)
        decay_group("vo", self.v_proj.weight, self.out_proj.weight)

    def qk_ov_weights(self) -> tuple[nn.Parameter, ...]:
        """(W_Q, W_K, W_V, W_O) as nn.Linear weights, for lm.training.callbacks.rank_monitor."""
        return self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.out_proj.weight

    @classmethod
    def mean_context(cls, seq_len: int, **options) -> float:
        """Keys a query sees on average over a sequence of seq_len: (T + 1) / 2 causally, what a causal kernel that
        skips masked blocks computes."""
        return (seq_len + 1) / 2

    @classmethod
    def op_flops_per_token(cls, d_model, n_heads, head_dim, seq_len, training, **options) -> float:
        """q k^T and the weighted sum of v, 2 x 2 x head_dim per key seen, for every query head; 3x training."""
        return (3 if training else 1) * 2 * 2 * n_heads * head_dim * cls.mean_context(seq_len, **options)

    def plain_causal(self, T: int, seen: int, starts: torch.Tensor | None) -> bool:
        """Whether a call's mask is the causal one: no cache, no documents, and no window shorter than the call."""
        return seen == 0 and starts is None and (self.window is None or self.window >= T)

    def kernel(self, device: torch.device, T: int, seen: int, starts: torch.Tensor | None = None) -> str:
        """"sdpa" or "flex" for a call of T tokens after `seen` on `device`: the `kernel` option, or for "auto"
        FlexAttention on CUDA where a call without a KV cache has more than the causal mask (a window shorter than the
        call, or documents), which SDPA would take dense and FlexAttention by blocks; SDPA elsewhere: its is_causal
        kernel for the causal mask, the decoding steps (a new block mask per step), and the CPU, where FlexAttention
        trains only in its math form, several times slower than SDPA, and its compiled inference kernel gains only at
        long lengths with most blocks masked, after a compile per length (docs/performance-history.md,
        "FlexAttention")."""
        if self.options.kernel != "auto":
            return self.options.kernel
        return "flex" if device.type == "cuda" and seen == 0 and not self.plain_causal(T, seen, starts) else "sdpa"

    def allowed(self, T: int, seen: int, cached: int, device, starts: torch.Tensor | None = None):
        """[T, cached + T] bool (or [B, 1, T, cached + T] with document starts): which keys (the cached ones, then the
        T new ones) each new query may see. starts [B, T]: the absolute position where each query's document
        starts; keys before it belong to another document."""
        if self.plain_causal(T, seen, starts):
            return None  # SDPA's is_causal
        query = torch.arange(seen, seen + T, device=device)[:, None]
        key = torch.arange(seen - cached, seen + T, device=device)[None, :]
        mask = key <= query
        if self.window is not None:
            mask = mask & (key > query - self.window)
        if starts is not None:
            mask = (mask & (key >= starts[..., None]))[:, None]  # [B, 1 (heads), T, keys]
        return mask

    def forward(self, x: torch.Tensor, state: tuple | None = None, reset: torch.Tensor | None = None):
        return self.attend(*self.project(x, state, reset), state)

    def project(self, x: torch.Tensor, state: tuple | None, reset: torch.Tensor | None):
        """(q, k, v [B, heads, T, head_dim], rotated at their positions; seen; starts [B, T] or None, each query's
        document start; the start carried on) for a call that follows `state`, of which only (seen, start) is read."""
        B, T, _ = x.shape
        seen, start = (0, None) if state is None else state[2:]
        positions = torch.arange(seen, seen + T, device=x.device)
        starts = None  # absolute position of each query's document start, [B, T]
        if reset is not None or start is not None:
            carried = torch.zeros(B, dtype=torch.long, device=x.device) if start is None else start
            starts = carried[:, None].expand(B, T)
            if reset is not None:  # a reset within this call moves the start there
                since = steps_since_reset(reset)
                starts = torch.where(since <= torch.arange(T, device=x.device), positions - since, starts)
            start = starts[:, -1]
        rope_positions = positions - starts if starts is not None and self.options.rope_restart else positions
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        cos, sin = rotary_tables(rope_positions, self.head_dim, self.rope_theta, q.dtype)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        return q, k, v, seen, starts, start

    def attend(self, q, k, v, seen: int, starts: torch.Tensor | None, start, state: tuple | None):
        """The output and new state of a call from `project`'s results, after the keys and values of `state`."""
        B, _, T, _ = q.shape
        if state is not None:
            k = torch.cat([state[0], k], dim=2)
            v = torch.cat([state[1], v], dim=2)
        cached, gqa = k.shape[2] - T, self.n_kv_heads != self.n_heads
        if self.kernel(q.device, T, seen, starts) == "flex":
            document_start = None if starts is None else starts - (seen - cached)  # as indices into k
            block_mask = attention_block_mask(T, cached, self.window, document_start, q.device)
            y = flex_attend(q, k, v, block_mask, enable_gqa=gqa, window=self.window, documents=starts is not None)
        elif cached and T > 1 and starts is None and self.window is None and (q.is_cuda or torch.is_grad_enabled()):
            y = causal_after_cache(q, k, v, gqa)  # a piece after the cache in training (context parallelism)
        else:
            mask = self.allowed(T, seen, cached, q.device, starts)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if self.window is not None:  # the next token sees the last window - 1 of these
            k, v = self.last_window(k), self.last_window(v)
        return self.out_proj(y), (k, v, seen + T, start)

    def last_window(self, keys: torch.Tensor) -> torch.Tensor:
        """The last window - 1 of keys (or values) [B, heads, T, head_dim]: what the next token can see of them."""
        return keys[:, :, max(0, keys.shape[2] - (self.window - 1)):]

    @torch._disable_dynamo  # eager under torch.compile, as lm.mixers.context_parallel.mix_in_parallel says why
    def mix_in_context(self, x: torch.Tensor, reset: torch.Tensor | None, group) -> torch.Tensor:
        """The output on this rank's piece x of each window (lm.mixers.context_parallel): its queries, keys and values
        at their positions in the window (RoPE counts from rank i's first token, i x the piece; with documents, from
        the start of the document the piece begins in, found from the gathered resets), then the earlier pieces' keys
        and values gathered from their ranks (SWA keeps the last window - 1)."""
        B, length, _ = x.shape
        seen, start = group.index * length, None
        if reset is not None:  # the document a piece begins in starts at the last reset before it (or at 0)
            x, every = gather_pieces(x, reset.to(torch.uint8), group)  # (gloo gathers no bool)
            before = torch.cat(every[:group.index] or [reset[:, :0]], dim=1).bool()
            positions = torch.arange(before.shape[1], device=x.device)
            start = torch.where(before, positions, 0).amax(1) if before.shape[1] else \
                reset.new_zeros(B, dtype=torch.long)
        q, k, v, _, starts, start_after = self.project(x, (None, None, seen, start), reset)
        q, every = gather_pieces(q, (k, v), group)  # tied to q, which every rank's output needs
        keys, values = (torch.cat([pair[i] for pair in every[:group.index]] or [t[:, :, :0]], dim=2)
                        for i, t in ((0, k), (1, v)))
        if self.window is not None:
            keys, values = self.last_window(keys), self.last_window(values)
        y, _ = self.attend(q, k, v, seen, starts, start_after, (keys, values, seen, start))
        return y

"""Causal softmax attention with rotary position embeddings, grouped-query heads and a KV cache."""

import torch
import torch.nn.functional as F
from torch import nn


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple:
    """cos and sin [1, T, 1, head_dim / 2] of the angles position * theta^(-2i/head_dim), shared by q and k."""
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]  # [T, d/2]
    return angles.cos()[None, :, None, :].to(dtype), angles.sin()[None, :, None, :].to(dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + d/2]) of x [B, T, H, d] by the angles whose cos and sin are given."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Multi-head causal attention (RoPE on q and k, optional grouped-query heads).

    The state is the KV cache ``(k, v)``, each [B, n_kv_heads, T_seen, head_dim]; a call with a state attends to
    the cached tokens and to its own tokens causally, at positions that continue after the cache.

    Parameters: d_model * head_dim * (2 * n_heads + 2 * n_kv_heads) (q, k, v, out projections, no biases).
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0,
                 n_kv_heads: int | None = None, rope_theta: float = 10000.0):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if head_dim % 2:
            raise ValueError(f"head_dim ({head_dim}) must be even for rotary embeddings")
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_theta = n_heads, n_kv_heads, head_dim, rope_theta
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)

    @staticmethod
    def param_count(d_model, n_heads, head_dim, n_kv_heads=None, **_) -> int:
        return d_model * head_dim * (2 * n_heads + 2 * (n_kv_heads or n_heads))

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None):
        B, T, _ = x.shape
        seen = 0 if state is None else state[0].shape[2]
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        cos, sin = rotary_tables(torch.arange(seen, seen + T, device=x.device), self.head_dim, self.rope_theta, q.dtype)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        if state is not None:
            k = torch.cat([state[0], k], dim=2)
            v = torch.cat([state[1], v], dim=2)
        gqa = self.n_kv_heads != self.n_heads
        if seen == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            # is_causal aligns the mask to the top left; with a cache the queries are the last T positions.
            mask = torch.ones(T, seen + T, dtype=torch.bool, device=x.device).tril(diagonal=seen)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.out_proj(y), (k, v)

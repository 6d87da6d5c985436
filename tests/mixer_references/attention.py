"""Causal softmax attention (Vaswani et al., 2017) with rotary position embeddings (Su et al., RoFormer), token by
token in float64:

    q_t = R(p_t) W_Q x_t,  k_t = R(p_t) W_K x_t,  v_t = W_V x_t   (per head; grouped-query heads share k and v)
    o_t = sum_{s in keys(t)} softmax_s(q_t . k_s / sqrt(d)) v_s,  y_t = W_O [o_t^1, ..., o_t^H]

keys(t): every earlier token of t's document and t itself (the last `window` of them for sliding-window attention).
R(p) rotates the pairs (i, i + d/2) (lm's rotate-half layout) by p * theta^(-2i/d); p counts from the document's start
with rope_restart, from the row's first token without. A reset clears the KV cache. Query head h reads key/value head
h // (n_heads / n_kv_heads).

lm builds its rotary tables (the angles and their cos and sin) in float32 whatever the model's dtype; the reference
builds them alike, so that the rest is checked to float64 precision.
"""

import math

import torch

from mixer_references import reference


def rotary(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """x [heads, d] rotated by position * theta^(-2i/d) in the pairs (x_i, x_{i + d/2})."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = torch.tensor(float(position), dtype=torch.float32) * freqs  # float32, as lm's tables
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def attend(mixer, x, state, reset, window: int | None = None):
    """Softmax attention over each token's document (the last `window` tokens of it, itself included, if given)."""
    B, T, _ = x.shape
    H, d = mixer.n_heads, mixer.head_dim
    Hkv = mixer.options.n_kv_heads or H
    theta, restart = mixer.options.rope_theta, mixer.options.rope_restart
    Wq, Wk, Wv, Wo = mixer.q_proj.weight, mixer.k_proj.weight, mixer.v_proj.weight, mixer.out_proj.weight
    rows = [{"k": [], "v": [], "pos": 0} for _ in range(B)] if state is None else state
    rows = [{"k": list(r["k"]), "v": list(r["v"]), "pos": r["pos"]} for r in rows]  # the caller's state stays
    out = []
    for b in range(B):
        row, ys = rows[b], []
        for t in range(T):
            if reset is not None and reset[b, t]:
                row["k"], row["v"] = [], []  # the KV cache holds the current document only
                if restart:
                    row["pos"] = 0
            xt = x[b, t]
            q = (Wq @ xt).view(H, d)
            k = (Wk @ xt).view(Hkv, d)
            v = (Wv @ xt).view(Hkv, d)
            row["k"].append(rotary(k, row["pos"], theta))
            row["v"].append(v)
            q = rotary(q, row["pos"], theta)
            row["pos"] += 1
            keys, values = row["k"], row["v"]
            if window is not None:
                keys, values = keys[-window:], values[-window:]
            keys, values = torch.stack(keys), torch.stack(values)  # [n, Hkv, d]
            heads = []
            for h in range(H):
                g = h // (H // Hkv)
                scores = keys[:, g] @ q[h] / math.sqrt(d)
                weights = torch.exp(scores - scores.max())
                heads.append((weights / weights.sum()) @ values[:, g])
            ys.append(Wo @ torch.cat(heads))
        out.append(torch.stack(ys))
    return torch.stack(out), rows


@reference("attention", variants=[{}, {"n_kv_heads": 1}, {"n_kv_heads": 2}, {"rope_restart": False},
                                  {"rope_theta": 50.0}])
def forward(mixer, x, state, reset):
    return attend(mixer, x, state, reset)

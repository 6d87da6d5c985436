"""FlexAttention (torch.nn.attention.flex_attention) for attention's masks: the rule of `Attention.allowed` (causal, a
sliding window of `window` keys, only keys of the query's own document, cached keys first) as a `mask_mod`, from which
`create_block_mask` keeps only the key blocks each block of queries needs. Compiled on CUDA, sliding-window attention
then costs T x window rather than T^2, and a document mask is never built dense ([B, T, T]).

Where it runs:
    CUDA    torch.compile(flex_attention) and torch.compile(create_block_mask), each compiled once per process (and
            again for a new shape): one fused kernel, forward and backward, that skips the masked blocks.
    CPU     torch compiles FlexAttention for the CPU (a C++ kernel) for inference only, in float32, bfloat16 and
            float16, and its flex_attention refuses inputs that need gradients. A CPU call that needs gradients, or
            is float64, runs FlexAttention's math form instead: the higher-order op that eager flex_attention runs,
            with its own backward. It builds the scores dense, as SDPA's mask does; it is there to check the masks.
            Not on the CPU (torch 2.13): documents inside an enclosing torch.compile (inductor's CPU kernel takes no
            mask_mod tensor computed in the same graph: "NoValidChoicesError"), and training under one (no backward).

Attention's "auto" kernel takes FlexAttention on CUDA only (docs/performance.md has the CPU figures).
"""

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

COMPILED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what inductor's CPU FlexAttention accepts


def attention_mask_mod(cached: int, window: int | None = None, document_start: torch.Tensor | None = None):
    """mask_mod(b, h, q_idx, kv_idx) -> whether query q_idx (of the call's T) may see key kv_idx (of cached + T, the
    cached keys first): a key at or before the query, within its last `window` keys (itself included), and at or after
    document_start[b, q_idx], the key index where that query's document starts (negative: before the cache)."""

    def allowed(b, h, q_idx, kv_idx):
        query = q_idx + cached  # the query's own key index
        mask = kv_idx <= query
        if window is not None:
            mask = mask & (kv_idx > query - window)
        if document_start is not None:
            mask = mask & (kv_idx >= document_start[b, q_idx])
        return mask

    return allowed


@functools.cache
def compiled(fn, dynamic: bool | None = None):
    """torch.compile(fn), once per process: PyTorch's advice for flex_attention (eager, it builds the scores dense) and
    create_block_mask (eager, it builds the mask dense before reducing it to blocks)."""
    return torch.compile(fn, dynamic=dynamic)


def attention_block_mask(T: int, cached: int, window: int | None, document_start: torch.Tensor | None,
                         device: torch.device) -> BlockMask:
    """The BlockMask of `attention_mask_mod` for T queries over cached + T keys; one per batch row with documents, one
    for all rows (and heads) without."""
    mask_mod = attention_mask_mod(cached, window, document_start)
    rows = None if document_start is None else document_start.shape[0]
    build = create_block_mask if device.type == "cpu" else compiled(create_block_mask)
    return build(mask_mod, rows, None, T, cached + T, device=device)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                enable_gqa: bool = False) -> torch.Tensor:
    """Softmax attention [B, heads, T, head_dim] of q [B, heads, T, d] over k, v [B, kv heads, keys, d] where
    block_mask allows; compiled where torch compiles it (module docstring), the math form elsewhere."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.device.type != "cpu":
        return compiled(flex_attention)(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    if q.dtype in COMPILED_CPU_DTYPES and not needs_grad:
        # Static shapes: a second length would otherwise recompile with symbolic ones, which inductor's CPU template
        # turns into C++ that does not compile (torch 2.13).
        return compiled(flex_attention, dynamic=False)(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    return flex_math(q, k, v, block_mask, enable_gqa)


def flex_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
              enable_gqa: bool = False) -> torch.Tensor:
    """FlexAttention's math form with its backward, on any device and dtype: the higher-order op that eager
    flex_attention calls, called directly, since flex_attention's CPU check refuses inputs that need gradients
    (torch 2.13) although this form has a backward. Its mask is the block mask's mask_mod, applied to every score."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op
    from torch.nn.attention import flex_attention as flex

    if not enable_gqa and q.shape[1] != k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads over {k.shape[1]} key heads need enable_gqa")
    options = flex._apply_kernel_options(q, k, v, False, None, None)
    return flex_attention_op(q, k, v, flex._identity, block_mask.as_tuple(), q.shape[-1] ** -0.5, options)[0]

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

from lm.ops import self_check

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
                enable_gqa: bool = False, window: int | None = None, documents: bool = False) -> torch.Tensor:
    """Softmax attention [B, heads, T, head_dim] of q [B, heads, T, d] over k, v [B, kv heads, keys, d] where
    block_mask allows; compiled where torch compiles it (module docstring), the math form elsewhere. window and
    documents say what the block mask was built from (`attention_block_mask`), for the compiled kernel's self-check on
    CUDA (`flex_agrees`); where it disagrees with the math form, the math form runs."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.device.type != "cpu":
        if not flex_agrees(q, k, enable_gqa, window, documents):
            return flex_math(q, k, v, block_mask, enable_gqa)
        return compiled(flex_attention)(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    if q.dtype in COMPILED_CPU_DTYPES and not needs_grad:
        # Static shapes: a second length would otherwise recompile with symbolic ones, which inductor's CPU template
        # turns into C++ that does not compile (torch 2.13).
        return compiled(flex_attention, dynamic=False)(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    return flex_math(q, k, v, block_mask, enable_gqa)


def flex_agrees(q: torch.Tensor, k: torch.Tensor, enable_gqa: bool, window: int | None, documents: bool) -> bool:
    """The compiled FlexAttention kernel's self-check (lm.ops.self_check) against its math form, outputs and
    gradients, once per device and shape class: the dtype, the head size, grouped heads or not, and the mask's kind
    (a window, documents, a KV cache). The input: one row, two query heads, two of FlexAttention's blocks of 128 and
    an odd tail. It runs through a compiled function of its own and an eager block mask, so that its shapes never
    reach the compiled kernel and mask of the calls (a second shape would recompile those with dynamic shapes)."""
    cached, head_dim = k.shape[2] - q.shape[2], q.shape[-1]
    shape_class = (q.dtype, head_dim, enable_gqa, window is not None, documents, cached > 0)

    def make_inputs(g):
        T, extra = 2 * 128 + 3, 3 if cached > 0 else 0
        kv_heads = 1 if enable_gqa else 2
        document_start = None
        if documents:
            steps = torch.arange(T, device=g.device)
            document_start = torch.where(self_check.resets(1, T, g.device), steps, 0).cummax(-1).values + extra
        mask_mod = attention_mask_mod(extra, None if window is None else 64, document_start)
        block_mask = create_block_mask(mask_mod, None if document_start is None else 1, None, T, extra + T,
                                       device=g.device)
        return dict(q=self_check.normal(g, 1, 2, T, head_dim, dtype=q.dtype).requires_grad_(),
                    k=self_check.normal(g, 1, kv_heads, extra + T, head_dim, dtype=k.dtype).requires_grad_(),
                    v=self_check.normal(g, 1, kv_heads, extra + T, head_dim, dtype=k.dtype).requires_grad_(),
                    block_mask=block_mask, enable_gqa=enable_gqa)

    return self_check.checked("FlexAttention (compiled)", q.device, shape_class, compiled(_flex_for_check),
                              flex_math, make_inputs, q.dtype, bounds="flex")


def _flex_for_check(q, k, v, block_mask, enable_gqa):
    """flex_attention through a frame of its own, compiled for the self-check alone (`flex_agrees`)."""
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


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

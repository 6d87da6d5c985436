"""The output head and its cross-entropy over chunks of tokens, so that the [tokens, vocab] logits never exist whole.

For hidden states x [N, d], the head W [V, d], targets y [N] and an optional soft cap c:

    z = x W^T,   l = c tanh(z / c) (or l = z),   loss_n = logsumexp(l_n) - l_n[y_n]

The mean loss's gradients are dl = (softmax(l) - onehot(y)) / N, dz = dl (1 - tanh(z / c)^2), dx = dz W and
dW = dz^T x. The training form computes them chunk by chunk during the forward pass, where each chunk's logits
exist anyway, and keeps only dx and dW (the size of x and W) for the backward pass: no logits are stored, and none
are computed twice. Targets equal to IGNORE count for nothing (F.cross_entropy's ignore_index).

`head_cross_entropy_reference` is the plain form (the whole logits, autograd) that the tests hold this one to. On CUDA,
where liger-kernel is installed (the extra `gpu`), its fused linear cross-entropy (Triton) takes the mean form.
"""

import functools

import torch
import torch.nn.functional as F

from lm.ops import self_check
from lm.ops.kernel_packages import import_kernels

IGNORE = -100

# Logit elements per chunk: 2^23 float32 values are 32 MiB, a few of which exist at a time.
CHUNK_ELEMENTS = 2**23


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk for a head of vocab_size rows."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


def wide(t: torch.Tensor) -> torch.Tensor:
    """float32, or float64 where t is (the tests' precision)."""
    return t if t.dtype == torch.float64 else t.float()


def capped_logits(x: torch.Tensor, weight: torch.Tensor, soft_cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logits c tanh(x W^T / c), their derivative with respect to x W^T, or None without a cap)."""
    if not soft_cap:
        return wide(F.linear(x, weight)), None
    # tanh(x W^T / c) from x / c: the division runs over d_model columns rather than the vocabulary
    t = torch.tanh(wide(F.linear(x / soft_cap, weight)))
    slope = torch.mul(t, t).neg_().add_(1)
    return t.mul_(soft_cap), slope


def chunk_losses(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, soft_cap: float | None):
    """Per-token loss of one chunk (0 at IGNORE), with its log-softmax and the soft cap's slope (for the gradient)."""
    logits, slope = capped_logits(x, weight, soft_cap)
    log_probs = torch.log_softmax(logits, dim=-1)
    kept = targets != IGNORE
    picked = log_probs.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    return -picked * kept, log_probs, slope, kept


class _MeanHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, soft_cap, chunk):
        count = (targets != IGNORE).sum().clamp(min=1)
        dtype = wide(x[:0]).dtype
        total = torch.zeros((), dtype=dtype, device=x.device)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=x.device) if ctx.needs_input_grad[1] else None
        for start in range(0, x.shape[0], chunk):
            xc, yc = x[start:start + chunk], targets[start:start + chunk]
            losses, log_probs, slope, kept = chunk_losses(xc, weight, yc, soft_cap)
            total += losses.sum()
            if grad_x is None and grad_w is None:
                continue
            dl = log_probs.exp_()  # softmax, in place of the log-softmax
            dl[torch.arange(len(yc), device=x.device), yc.clamp(min=0)] -= 1
            dz = (dl if slope is None else dl.mul_(slope)).to(xc.dtype)
            # The mean's weights (0 at IGNORE, 1 / count elsewhere) scale rows: applied to x's chunk and to dx's,
            # [chunk, d] each, rather than to the [chunk, vocab] dz.
            rows = (kept.to(dtype) / count)[:, None]
            if grad_x is not None:
                grad_x[start:start + chunk] = (dz @ weight.to(dz.dtype)) * rows
            if grad_w is not None:
                grad_w.addmm_(dz.t().to(dtype), xc.to(dtype) * rows)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        grad_x = None if grad_x is None else grad_x * grad_loss.to(grad_x.dtype)
        grad_w = None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None


@functools.cache
def liger_loss():
    """liger-kernel's fused linear cross-entropy, or None where it is not installed."""

    def load():
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy

    return import_kernels(load)


def head_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, soft_cap: float | None = None,
                       reduction: str = "mean", chunk: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Cross-entropy of the head weight [V, d] on x [N, d] against targets [N], in float32, never holding more than
    `chunk` tokens' logits (default `chunk_tokens(V)`).

    reduction "mean": the mean over the targets that are not IGNORE, with gradients for x and weight.
    reduction "none": the loss of each token [N] (0 at IGNORE), only where no gradient is asked for (evaluation).
    backend "auto": liger-kernel's fused form for a training mean on CUDA where it is installed, else "torch"."""
    if reduction not in ("mean", "none") or backend not in ("auto", "torch", "liger"):
        raise ValueError(f"reduction must be 'mean' or 'none' and backend 'auto', 'torch' or 'liger', "
                         f"got {reduction!r}, {backend!r}")
    chunk = chunk or chunk_tokens(weight.shape[0])
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        losses = torch.cat([chunk_losses(x[s:s + chunk], weight, targets[s:s + chunk], soft_cap)[0]
                            for s in range(0, x.shape[0], chunk)])
        return losses if reduction == "none" else losses.sum() / (targets != IGNORE).sum().clamp(min=1)
    if reduction == "none":
        raise ValueError("head_cross_entropy(reduction='none') has no gradient: use it under torch.no_grad()")
    fused = liger_loss() if backend == "liger" or (backend == "auto" and x.is_cuda) else None
    if backend == "liger" and fused is None:
        raise RuntimeError("backend 'liger' needs liger-kernel (pip install 'lm[gpu]')")
    if fused is not None and _liger_agrees(fused, x, weight, soft_cap, chunk):
        return _liger_mean(fused, x, weight, targets, soft_cap)
    return _MeanHeadCrossEntropy.apply(x, weight, targets, soft_cap, chunk)


def _liger_mean(fused, x, weight, targets, soft_cap):
    out = fused(x, weight, targets, ignore_index=IGNORE, reduction="mean", softcap=soft_cap)
    return wide(out[0] if isinstance(out, tuple) else out)


def _liger_agrees(fused, x, weight, soft_cap, chunk) -> bool:
    """liger's self-check (lm.ops.self_check), as tests/test_model_gpu.py compares it, smaller: the loss, dx and dW
    of 300 tokens (some ignored) over a head of 4099 rows of the call's width, under the caller's autocast (training
    runs liger under bf16-mixed). Checked whether "auto" picked it or the call named it. The shape class: the dtypes,
    the width, the autocast dtype, a soft cap or not."""
    d = x.shape[-1]
    autocast = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
    shape_class = (x.dtype, weight.dtype, d, autocast, bool(soft_cap))

    def make_inputs(g):
        N, V = 300, 4099
        targets = torch.randint(0, V, (N,), generator=g, device=g.device)
        targets[::7] = IGNORE
        return dict(x=self_check.normal(g, N, d, dtype=x.dtype).requires_grad_(),
                    weight=self_check.normal(g, V, d, scale=d ** -0.5, dtype=weight.dtype).requires_grad_(),
                    targets=targets)

    fast = lambda x, weight, targets: _liger_mean(fused, x, weight, targets, soft_cap)
    reference = lambda x, weight, targets: _MeanHeadCrossEntropy.apply(x, weight, targets, soft_cap, chunk)
    return self_check.checked("head cross-entropy (liger fused linear cross-entropy)", x.device, shape_class, fast,
                              reference, make_inputs, x.dtype, bounds="liger", keep_autocast=True)


def head_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 soft_cap: float | None = None, reduction: str = "mean") -> torch.Tensor:
    """The same loss from the whole [N, V] logits, through autograd: what the model computed before chunking."""
    logits = wide(F.linear(x, weight))
    if soft_cap:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction=reduction)

"""Effective rank of each attention layer's W_Q,h^T W_K,h and W_O,h W_V,h during training.

Weight decay drives these per-head products towards low rank (optim.qk_weight_decay and optim.vo_weight_decay
give them their own decay); logging the rank lets a comparison of runs show it. RoPE sits between W_Q and W_K, so
W_Q^T W_K is the bilinear form of scores at relative distance 0, the usual proxy.
"""

from contextlib import contextmanager

import lightning as L
import torch


def effective_rank(m: torch.Tensor) -> torch.Tensor:
    """Roy & Vetterli (2007): exp of the Shannon entropy of the singular values normalised to sum 1, for each
    matrix of m [..., rows, cols]. Between 1 and min(rows, cols) for a nonzero matrix; 0 for a zero one."""
    s = torch.linalg.svdvals(m.double())
    total = s.sum(-1)
    p = s / total.clamp_min(torch.finfo(s.dtype).tiny)[..., None]
    entropy = -torch.special.xlogy(p, p).sum(-1)  # 0 log 0 = 0
    return torch.where(total > 0, entropy.exp(), torch.zeros_like(entropy))


def product_core(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A small matrix with the singular values of a @ b^T, for a, b [..., d, k] with k <= d: with reduced QRs
    a = Q_a R_a and b = Q_b R_b, a b^T = Q_a (R_a R_b^T) Q_b^T, and Q_a, Q_b have orthonormal columns. So the SVD
    is of k x k matrices rather than d x d ones."""
    return torch.linalg.qr(a.double()).R @ torch.linalg.qr(b.double()).R.mT


def head_ranks(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, n_heads: int,
               n_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Effective ranks [n_heads] of W_Q,h^T W_K,h and of W_O,h W_V,h from nn.Linear weights (q, k, v: [heads *
    head_dim, d]; o: [d, n_heads * head_dim]). Query head h reads kv head h // (n_heads / n_kv_heads), as in
    scaled_dot_product_attention's grouped-query heads."""
    d = wq.shape[1]
    per_kv = lambda w: w.reshape(n_kv_heads, head_dim, d).mT.repeat_interleave(n_heads // n_kv_heads, dim=0)
    q = wq.reshape(n_heads, head_dim, d).mT  # [H, d, head_dim]: W_Q,h^T
    o = wo.reshape(d, n_heads, head_dim).transpose(0, 1)  # [H, d, head_dim]: W_O,h
    return effective_rank(product_core(q, per_kv(wk))), effective_rank(product_core(o, per_kv(wv)))


@contextmanager
def full_weights(params: list[torch.Tensor]):
    """The full tensors of params on every rank: all-gathered from FSDP2 (DTensor) or DeepSpeed ZeRO-3 shards,
    as they are otherwise. Sharded, it is a collective: every rank must enter it."""
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 partitioned
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            yield [p.data for p in params]
    else:
        yield [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]


def is_sharded(module: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") or hasattr(p, "full_tensor") for p in module.parameters())


class RankMonitor(L.Callback):
    """Every `every_n_steps` optimizer steps (and at the start), logs the mean over heads of the effective rank
    of W_Q,h^T W_K,h and W_O,h W_V,h of each attention layer i (`rank/qk/layer{i}`, `rank/ov/layer{i}`) and their
    mean over layers (`rank/qk`, `rank/ov`)."""

    def __init__(self, every_n_steps: int):
        if every_n_steps <= 0:
            raise ValueError(f"every_n_steps must be positive, got {every_n_steps}")
        self.every = every_n_steps
        self._logged_at = None

    def on_train_start(self, trainer, pl_module):
        self._maybe_log(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._maybe_log(trainer, pl_module)  # once per optimizer step: micro-batches of one step share it

    @torch.no_grad()
    def _maybe_log(self, trainer, pl_module):
        step = trainer.global_step
        if step % self.every or step == self._logged_at:
            return
        self._logged_at = step
        layers = [(i, block.mixer) for i, block in enumerate(pl_module.model.blocks)
                  if hasattr(block.mixer, "qk_ov_weights")]  # the mixers with attention's W_Q, W_K, W_V, W_O
        if not layers or not (trainer.is_global_zero or is_sharded(pl_module)):
            return  # unsharded, rank 0 alone has all it needs; sharded, every rank takes part in the gathers
        metrics = {}
        for i, attn in layers:
            with full_weights(list(attn.qk_ov_weights())) as (wq, wk, wv, wo):
                if trainer.is_global_zero:
                    qk, ov = head_ranks(wq, wk, wv, wo, attn.n_heads, attn.n_kv_heads, attn.head_dim)
                    metrics[f"rank/qk/layer{i}"], metrics[f"rank/ov/layer{i}"] = qk.mean().item(), ov.mean().item()
        if trainer.is_global_zero:
            metrics["rank/qk"] = sum(metrics[f"rank/qk/layer{i}"] for i, _ in layers) / len(layers)
            metrics["rank/ov"] = sum(metrics[f"rank/ov/layer{i}"] for i, _ in layers) / len(layers)
            # Straight to the loggers: pl_module.log's step metrics reach them only on trainer.log_every steps.
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

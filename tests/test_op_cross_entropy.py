"""The chunked head cross-entropy against the whole-logits form it replaces, and the proof that no [tokens, vocab]
tensor is made."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lm.model import LanguageModel, LMConfig
from lm.ops.cross_entropy import IGNORE, head_cross_entropy, head_cross_entropy_reference
from lm.training.module import next_token_loss


def inputs(N=53, d=12, V=37, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, d, generator=g, dtype=dtype) * 2).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    y[::5] = IGNORE
    return x, w, y


def loss_and_grads(fn, x, w, y, **kw):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(x, w, y, **kw)
    (loss * 1.7).backward()  # a gradient other than 1 reaches the backward
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("soft_cap", [None, 3.0])
@pytest.mark.parametrize("chunk", [1, 7, 53, 64])
def test_chunked_equals_whole_logits_float64(soft_cap, chunk):
    x, w, y = inputs()
    got = loss_and_grads(head_cross_entropy, x, w, y, soft_cap=soft_cap, chunk=chunk)
    want = loss_and_grads(head_cross_entropy_reference, x, w, y, soft_cap=soft_cap)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_float32_to_rounding_and_per_token_losses():
    x, w, y = inputs(N=301, d=64, V=1000, dtype=torch.float32)
    got = loss_and_grads(head_cross_entropy, x, w, y, soft_cap=30.0, chunk=40)
    want = loss_and_grads(head_cross_entropy_reference, x, w, y, soft_cap=30.0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(head_cross_entropy(x, w, y, 30.0, reduction="none", chunk=40),
                                   head_cross_entropy_reference(x, w, y, 30.0, reduction="none"))
    with pytest.raises(ValueError, match="no gradient"):
        head_cross_entropy(x, w, y, reduction="none")


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output has while the mode is on."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_the_model_loss_is_the_old_loss_and_never_holds_the_logits(monkeypatch):
    monkeypatch.setattr("lm.ops.cross_entropy.CHUNK_ELEMENTS", 4 * 512)  # 4 tokens of the 512-word vocabulary
    cfg = LMConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, head_dim=16, max_seq_len=64)
    model = LanguageModel(cfg)
    windows = torch.randint(0, 512, (2, 41))
    with LargestTensor() as largest:
        loss = next_token_loss(model, windows)
        loss.backward()
    got = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    assert largest.numel == 512 * 32  # the head weight and its gradient; a chunk has 4 x 512, the logits 80 x 512
    model.zero_grad()
    logits, _ = model(windows[:, :-1])
    want_loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())
    want_loss.backward()
    for a, b in zip(got, [want_loss.detach()] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

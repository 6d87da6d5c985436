"""GPU only: every mixer's model on CUDA in bf16 autocast, with its fast kernels (backend "auto"), against the same
model in float32 on the CPU; and liger-kernel's fused head cross-entropy against lm's chunked one. Skipped without
CUDA; with CUDA, a missing kernel package is an error."""

import copy
import sys

import pytest
import torch
from gpu_helpers import err_ratio, raw_kernels, require_gpu  # noqa: F401 (raw_kernels: an autouse fixture)

from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig
from lm.ops.cross_entropy import head_cross_entropy, liger_loss
from lm.ops.self_check import BOUNDS
from lm.training.module import next_token_loss

require_gpu("fla.ops.gated_delta_rule", "mlstm_kernels.torch", "liger_kernel.transformers.functional")


def loss_and_grads(model, windows):
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=windows.is_cuda):
        loss = next_token_loss(model, windows)
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_mixer_on_cuda_bf16_matches_cpu_float32(mixer):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=1024, d_model=256, n_layers=2, n_heads=2, head_dim=64, mixer=mixer, max_seq_len=256)
    model = LanguageModel(cfg)
    windows = torch.randint(0, 1024, (2, 257))  # T 256: a multiple of mlstm_kernels' 16 and of fla's chunks
    want_loss, want = loss_and_grads(model, windows)
    got_loss, got = loss_and_grads(copy.deepcopy(model).cuda(), windows.cuda())
    assert abs(got_loss - want_loss) < 2e-2 * want_loss
    errors = {name: err_ratio(got[name], want[name]) for name in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 5e-2, (worst, errors[worst])


@pytest.mark.parametrize("mixer", ["deltanet", "gated_deltanet"])
def test_the_delta_rule_mixers_reach_fla_under_autocast(mixer, monkeypatch):
    """Under CUDA autocast the mixer's q and k stay bf16 (F.normalize's norm would make them float32), so "auto" runs
    fla's kernel. Without a gradient: fla refuses no forward."""
    ops_module = sys.modules["lm.ops.delta_rule"]  # the module (the package's lm.ops.delta_rule is the function)
    real, calls = ops_module.fla_delta_rule, []
    monkeypatch.setattr(ops_module, "fla_delta_rule", lambda *a, **kw: calls.append(mixer) or real(*a, **kw))
    cfg = LMConfig(vocab_size=1024, d_model=256, n_layers=1, n_heads=2, head_dim=64, mixer=mixer, max_seq_len=256)
    model = LanguageModel(cfg).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randint(0, 1024, (2, 256), device="cuda"))
    assert calls == [mixer]


def test_head_loss_dispatches_to_liger_and_matches_the_chunked_torch_form():
    assert liger_loss() is not None
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3000, 512, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(50304, 512, device="cuda", generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, 50304, (3000,), device="cuda", generator=g)
    results = []
    for backend in ("auto", "torch"):  # auto: liger on CUDA
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as in training under bf16-mixed
            loss = head_cross_entropy(x, w, y, soft_cap=30.0, backend=backend)
        loss.backward()
        results.append((loss.detach().float(), x.grad.clone(), w.grad.clone()))
    (liger, dx, dw), (ours, dx_ref, dw_ref) = results
    bound = BOUNDS["liger"][x.dtype]
    assert abs(liger - ours) < bound.out * ours
    assert err_ratio(dx, dx_ref) < bound.grad and err_ratio(dw, dw_ref) < bound.grad


def test_the_self_check_keeps_liger(monkeypatch):
    """With the self-check on (lm.ops.self_check), liger's loss passes it under bf16 autocast, as training runs it."""
    from lm.ops import self_check

    monkeypatch.setenv("LM_KERNEL_SELF_CHECK", "1")
    self_check.forget()
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    w = torch.randn(1024, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        head_cross_entropy(x, w, torch.randint(0, 1024, (64,), device="cuda"), soft_cap=30.0).backward()
    [verdict] = self_check.verdicts().values()
    print("\nself-check:", verdict)
    assert verdict.ok

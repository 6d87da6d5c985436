"""GPU only: fla's kernels for the delta-rule family's newer ops (KDA and GDN-2's channel gates, Gated DeltaProduct,
the preconditioned gated delta rule) against lm's PyTorch ops, in bf16, with an initial state, the final state and
gradients, as tests/test_ops_gpu.py does for the older ops. Skipped without CUDA; with CUDA, a missing fla is an
error. Written without a GPU lent (docs/performance.md): what a lent machine runs first (bench/gpu.sh)."""

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import raw_kernels, require_gpu  # noqa: F401 (raw_kernels: an autouse fixture)
from test_ops_gpu import SCALE, B, H, K, T, V, check_against_torch

from lm.ops.delta_product import delta_product
from lm.ops.kda import kda
from lm.ops.precond_delta_rule import precond_delta_rule

require_gpu("fla.ops.kda", "fla.ops.gdn2", "fla.ops.gated_delta_product", "fla.ops.precond_gated_delta_rule")


def inputs(rows: int = 1, per_key: bool = True, channel_gates: bool = False, seed: int = 0) -> dict:
    """q [B, T, H, K]; k, v, beta with `rows` rows a token; a decay per key channel or per head (float32); beta in
    [0, 2] (negative eigenvalues); with channel gates, an erase gate over the keys and a write gate over the values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda")  # noqa: E731
    uniform = lambda *shape: torch.rand(*shape, generator=g, device="cuda")  # noqa: E731
    x = dict(q=F.normalize(rand(B, T, H, K), dim=-1).bfloat16(),
             k=F.normalize(rand(B, T * rows, H, K), dim=-1).bfloat16(),
             v=rand(B, T * rows, H, V).bfloat16(),
             beta=(2 * uniform(B, T * rows, H)).bfloat16(),
             log_decay=F.logsigmoid(rand(B, T, H, K) + 3) if per_key else F.logsigmoid(rand(B, T, H) + 3),
             initial_state=rand(B, H, K, V) * 0.1)
    if channel_gates:
        x.update(erase=(2 * uniform(B, T, H, K)).bfloat16(), write=uniform(B, T, H, V).bfloat16(), beta=None)
    return {n: t if t is None else t.requires_grad_() for n, t in x.items()}


def _kda(x, backend):
    return kda(x["q"], x["k"], x["v"], x["log_decay"], x["beta"], SCALE, erase=x.get("erase"), write=x.get("write"),
               initial_state=x["initial_state"], backend=backend)


def _delta_product(x, backend):
    return delta_product(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], SCALE, initial_state=x["initial_state"],
                         backend=backend)


@pytest.mark.parametrize("channel_gates", [False, True], ids=["kda", "gdn2"])
def test_kda_fla_matches_torch(channel_gates):
    check_against_torch(_kda, inputs(channel_gates=channel_gates))


@pytest.mark.parametrize("rows", [2, 3])
def test_delta_product_fla_matches_torch(rows):
    check_against_torch(_delta_product, inputs(rows=rows, per_key=False), gated_kernel="gated_delta_rule")


def test_precond_delta_rule_fla_matches_torch():
    g = torch.Generator(device="cuda").manual_seed(2)
    x = inputs(per_key=False)
    x["beta"] = x["beta"].detach().div(2).requires_grad_()
    beta_a = torch.rand(B, T, H, generator=g, device="cuda").bfloat16().requires_grad_()
    log_alpha_a = F.logsigmoid(torch.randn(B, T, H, generator=g, device="cuda") + 3).requires_grad_()
    state_a = torch.rand(B, H, K, generator=g, device="cuda") * 0.1

    def op(x, backend):
        out, (S, _) = precond_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], beta_a, log_alpha_a, SCALE,
                                         initial_state=(x["initial_state"], state_a), backend=backend)
        return out, S

    check_against_torch(op, x, gated_kernel="gated_delta_rule")

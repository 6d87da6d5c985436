"""The rank monitor: effective ranks of known spectra, per-head products with grouped-query heads, and real CPU runs
that log rank/qk and rank/ov into metrics.csv (and show decay on the attention matrices lowering the QK rank)."""

import csv
import math
from pathlib import Path

import pytest
import torch

from lm.mixers.attention import Attention
from lm.training.callbacks.rank_monitor import effective_rank, head_ranks, product_core
from lm.training.config import parse_run_config
from lm.training.train import train
from lm.util.errors import UserError


def orthonormal(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=generator)).Q


@pytest.mark.parametrize("r", [1, 3, 8])
def test_rank_r_with_equal_singular_values_has_effective_rank_r(r):
    g = torch.Generator().manual_seed(r)
    m = 2.5 * orthonormal(20, r, g) @ orthonormal(12, r, g).T
    assert effective_rank(m).item() == pytest.approx(r, abs=1e-9)


def test_diagonal_spectrum_gives_the_closed_form():
    s = torch.tensor([4.0, 2.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    p = s[:4] / s.sum()
    expected = math.exp(-float((p * p.log()).sum()))
    assert effective_rank(torch.diag(s)).item() == pytest.approx(expected, rel=1e-9)
    assert effective_rank(7 * torch.diag(s)).item() == pytest.approx(expected, rel=1e-9)  # scale-free
    assert effective_rank(torch.zeros(3, 3)).item() == 0.0


def test_product_core_has_the_singular_values_of_the_product():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 40, 6, generator=g), torch.randn(3, 40, 6, generator=g)
    full = torch.linalg.svdvals((a @ b.mT).double())[:, :6]
    assert torch.allclose(torch.linalg.svdvals(product_core(a, b)), full, rtol=1e-5, atol=1e-9)


def test_head_ranks_pair_each_query_head_with_its_grouped_kv_head():
    torch.manual_seed(0)
    attn = Attention(d_model=32, n_heads=4, head_dim=8, n_kv_heads=2)
    with torch.no_grad():
        wq, wk, wv, wo = (m.weight.double() for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj))
        wk[8:] *= torch.linspace(0.01, 1, 8, dtype=torch.float64)[:, None]  # kv head 1 (query heads 2, 3): skewed
        qk, ov = head_ranks(wq, wk, wv, wo, n_heads=4, n_kv_heads=2, head_dim=8)
        for h in range(4):
            rows, kv = slice(8 * h, 8 * h + 8), slice(8 * (h // 2), 8 * (h // 2) + 8)
            assert qk[h].item() == pytest.approx(effective_rank(wq[rows].T @ wk[kv]).item(), rel=1e-6)
            assert ov[h].item() == pytest.approx(effective_rank(wo[:, rows] @ wv[kv]).item(), rel=1e-6)
    assert qk[2] < qk[0] - 0.5


def rank_run(tmp: Path, data: str, name: str, steps: int, every: int, pattern: str, optim: str) -> list[dict]:
    """A short CPU run with trainer.rank_every; the rows of its metrics.csv that carry ranks."""
    config = tmp / f"{name}.yaml"
    config.write_text(f"""
run_dir: {tmp / name}
seed: 1
model: {{vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 2, head_dim: 16, max_seq_len: 32,
         layer_pattern: "{pattern}"}}
data: {{path: {data}, seq_len: 32, micro_batch: 4, num_workers: 0, val_windows: 4}}
optim: {{{optim}}}
strategy: {{accelerator: cpu}}
trainer: {{max_steps: {steps}, val_every: 1000, ckpt_every: 1000, keep_last: 1, log_every: 1, progress_bar: false,
           rank_every: {every}}}
""")
    train(*parse_run_config(["--config", str(config)]))
    with open(next((tmp / name).glob("logs/version_*/metrics.csv"))) as f:
        return [row for row in csv.DictReader(f) if row.get("rank/qk")]


def test_a_hybrid_run_logs_the_ranks_of_its_attention_layers(kjv_data, tmp_path):
    rows = rank_run(tmp_path, kjv_data, "hybrid", steps=4, every=2, pattern="attention,mamba2",
                    optim="lr: 3.0e-3, warmup_steps: 1")
    assert [int(row["step"]) for row in rows] == [0, 2, 4]
    assert "rank/qk/layer1" not in rows[0]  # layer 1 is mamba2
    for row in rows:
        for key in ("rank/qk/layer0", "rank/ov/layer0", "rank/qk", "rank/ov"):
            assert 1.0 <= float(row[key]) <= 16, (key, row[key])


def test_decay_on_the_attention_matrices_lowers_the_qk_rank(kjv_data, tmp_path, one_thread):
    optim = "lr: 1.0e-2, warmup_steps: 1, min_lr_ratio: 1.0, weight_decay: 0.0"
    free = rank_run(tmp_path, kjv_data, "free", 20, 20, "attention", optim)
    decayed = rank_run(tmp_path, kjv_data, "decayed", 20, 20, "attention",
                       optim + ", qk_weight_decay: 10.0, vo_weight_decay: 10.0")
    assert free[0]["rank/qk"] == decayed[0]["rank/qk"]  # the same initialisation
    # Decayed over free rank/qk: 0.57 (5.1 vs 9.0) at seed 1; 0.57-0.77 over seeds 0-7 (one thread). Without the
    # decay the two runs are one: 1.0.
    assert float(decayed[-1]["rank/qk"]) < 0.9 * float(free[-1]["rank/qk"])


def test_negative_rank_every_is_a_user_error():
    with pytest.raises(UserError, match="rank_every"):
        parse_run_config(["--trainer.rank_every", "-1"])

"""lm.bench.memory: the measurement sees known allocations exactly, and the table's figures agree with each other."""

import math
import re

import torch

from lm.bench.memory import bench_memory, tracked_peak_bytes

MIB = 2**20


def test_tracked_peak_is_the_most_bytes_alive_at_once():
    """96 MiB freed, then 32 MiB kept: the peak is 96 MiB (not their sum, not what is left at the end), above
    whatever the process held before (64 MiB here), to within the few bytes of the reductions' results."""
    before = torch.ones(64 * MIB // 4)
    kept = []

    def work():
        big = torch.ones(96 * MIB // 4)
        big.sum()
        del big
        kept.append(torch.ones(32 * MIB // 4))

    assert abs(tracked_peak_bytes(work) / MIB - 96) < 0.01
    assert abs(tracked_peak_bytes(lambda: torch.ones(8 * MIB // 4).sum()) / MIB - 8) < 0.01
    assert before.numel() and kept


def test_bench_memory_rows(tmp_path, capsys):
    result = bench_memory(mixers=["attention", "gated_deltanet"], lengths=[64, 2048], d_model=32, n_layers=1,
                          n_heads=2, head_dim=16, vocab_size=256, json_out=str(tmp_path / "memory.json"))
    rows = result["rows"]
    assert [(r["mixer"], r["T"]) for r in rows] == [("attention", 64), ("attention", 2048), ("gated_deltanet", 64),
                                                    ("gated_deltanet", 2048)]
    for r in rows:
        assert math.isclose(r["mib_per_1k_tokens"], r["peak_mib"] / (r["T"] / 1000))
    for short, long in (rows[:2], rows[2:]):
        # Tracked allocations see the short step's own activations (RSS read about 0 there: the allocator reused the
        # warm-up step's freed memory), and the memory of a step is linear in T: 32x the tokens, about 32x the peak.
        assert long["length_ratio"] == 32 and 0 < short["peak_mib"] < long["peak_mib"]
        assert math.isclose(long["growth_vs_shortest"], long["peak_mib"] / short["peak_mib"])
        assert 0.8 * 32 < long["growth_vs_shortest"] < 1.1 * 32, long
    # While it ran, stderr named each mixer as its runs started, and counted them (lm.bench.progress).
    said = [line.strip() for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.strip()]
    named = [m[1] for line in said if (m := re.match(r"lm bench memory: (\w+):", line))]
    assert list(dict.fromkeys(named)) == ["attention", "gated_deltanet"], said
    assert " 2/2 " in said[-1], said

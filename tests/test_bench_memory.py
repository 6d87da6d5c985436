"""bench.memory: the measurement sees a known allocation, and the table's figures agree with each other."""

import math

import torch

from bench.memory import bench_memory, fresh_processes, peak_growth_mib


def allocate_and_touch(mib: int) -> float:
    # A first, small run pages in the kernels' code and starts the thread pool, as step_peak_mib's warm-up step
    # does: on a busy machine those alone add tens of MiB to the first reading.
    torch.ones(2**16).sum()
    return peak_growth_mib(lambda: torch.ones(mib * 2**20 // 4).sum())  # ones() writes every page


def test_peak_growth_sees_a_known_allocation():
    with fresh_processes() as pool:
        small, big = pool.apply(allocate_and_touch, (8,)), pool.apply(allocate_and_touch, (96,))
    # 96 MiB and 8 MiB of float32: what is not the tensor (allocator, stray pages) is about the same in both runs.
    assert big >= 90 and 80 <= big - small <= 100, (small, big)


def test_bench_memory_rows(tmp_path):
    result = bench_memory(mixers=["attention", "gated_deltanet"], lengths=[64, 2048], d_model=32, n_layers=1,
                          n_heads=2, head_dim=16, vocab_size=256, json_out=str(tmp_path / "memory.json"))
    rows = result["rows"]
    assert [(r["mixer"], r["T"]) for r in rows] == [("attention", 64), ("attention", 2048), ("gated_deltanet", 64),
                                                    ("gated_deltanet", 2048)]
    for r in rows:
        assert math.isclose(r["mib_per_1k_tokens"], r["peak_mib"] / (r["T"] / 1000))
    for short, long in (rows[:2], rows[2:]):
        # The short step is the size of the warm-up step, whose freed memory the allocator reuses: its reading is
        # about 0 (even slightly negative). 2048 tokens keep several MiB of activations for the backward pass.
        assert long["length_ratio"] == 32 and long["peak_mib"] > max(short["peak_mib"], 0) + 1
        if short["peak_mib"] > 0:
            assert math.isclose(long["growth_vs_shortest"], long["peak_mib"] / short["peak_mib"])
        else:
            assert long["growth_vs_shortest"] is None

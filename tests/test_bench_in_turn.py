"""`lm bench train --in_turn`: the models' timed steps take turns, so that a shared machine's changing load falls on
all of them alike (no speed is asserted)."""

import math

import pytest
import torch
from throwaway_mixer import EMA

from lm.accounting.flops import train_flops_per_token
from lm.bench.train_speed import bench_train, time_in_turn
from lm.mixers import MIXERS, register
from lm.model import LMConfig


@pytest.fixture
def steps_seen():
    """The d_model of every model whose mixer runs a forward, in order: a throwaway mixer that notes it (not the
    accounting's calls on the meta device)."""
    mixers, seen = dict(MIXERS), []

    class Noted(EMA):
        def op_inputs(self, x, state, reset):
            if x.device.type != "meta":
                seen.append(self.d_model)
            return super().op_inputs(x, state, reset)

    register("noted")(Noted)
    yield seen
    MIXERS.clear()
    MIXERS.update(mixers)


def test_timed_steps_take_turns(steps_seen):
    cfgs = [LMConfig(vocab_size=64, d_model=d, n_layers=1, n_heads=2, head_dim=16, mixer="noted", max_seq_len=16)
            for d in (32, 48)]
    results = time_in_turn(cfgs, torch.device("cpu"), seq_len=16, batch=2, steps=3, warmup=1,
                           activation_checkpointing=False)
    assert steps_seen == [32, 48] + [32, 48] * 3  # each model's warmup, then one timed step each a round
    assert [r["params"] for r in results] == sorted(r["params"] for r in results) and len(results) == 2
    assert all(r["tokens_per_s"] > 0 and r["first_step_s"] > 0 for r in results)


def test_bench_rows_in_turn_are_those_of_each_model_at_each_length():
    result = bench_train(mixers=["attention", "gated_deltanet"], d_model=[32], seq_len=[24, 16], n_layers=1,
                         head_dim=16, batch=2, steps=1, warmup=0, in_turn=True)
    rows = result["rows"]
    assert result["in_turn"] and [(r["mixer"], r["seq_len"]) for r in rows] == [
        ("attention", 24), ("attention", 16), ("gated_deltanet", 24), ("gated_deltanet", 16)]
    for r in rows:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0
        cfg = LMConfig(mixer=r["mixer"], d_model=32, n_layers=1, n_heads=2, head_dim=16, vocab_size=8192,
                       max_seq_len=24)
        assert math.isclose(r["model_flops_per_token"], train_flops_per_token(cfg, r["seq_len"]), rel_tol=1e-12)

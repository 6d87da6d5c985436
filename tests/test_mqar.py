"""A 2-layer model of every mixer learns multi-query associative recall on CPU (zoology-style MQAR)."""

import pytest
import torch

from eval.mqar import STEPS, MQARTask, mqar_batch, train_mqar
from lm.mixers import MIXERS

TASK = MQARTask(vocab=32, pairs=4)
# Known gap (see docs/mqar.md): at this width Mamba2 and mLSTM plateau near 57% within any budget tried here
# (up to 3000 steps, learning rates 1e-3..1e-2, state sizes up to 4x). Strict, so a fix shows up as a failure
# here to remove the mark.
BELOW_90 = {"mamba2", "mlstm"}
# Fewer steps than `lm eval mqar` takes where fewer already clear 90% by a wide margin, to keep the suite short:
# at seed 0 DeltaNet reached 99.9% and Gated DeltaNet 98.5% after 200 steps, Mesa 99.7% after 150 (99.6-99.9% over
# seeds 0-2). Attention stays at 1500: after 1000 steps one seed of three was at 56%.
TEST_STEPS = {**STEPS, "deltanet": 200, "gated_deltanet": 200, "mesa": 150}


def test_mqar_batches_score_only_the_answers():
    inputs, targets = mqar_batch(TASK, 3, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (3, TASK.seq_len - 1)
    scored = targets != -100
    assert scored.sum(1).tolist() == [TASK.pairs] * 3
    for row in range(3):
        context = dict(zip(inputs[row, 0:8:2].tolist(), inputs[row, 1:8:2].tolist()))
        for pos in scored[row].nonzero().flatten().tolist():
            assert context[int(inputs[row, pos])] == int(targets[row, pos])  # the queried key's value


@pytest.mark.parametrize("mixer", [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason="known MQAR gap"))
                                   if m in BELOW_90 else m for m in sorted(MIXERS)])
def test_each_mixer_learns_mqar(mixer):
    result = train_mqar(mixer, TASK, steps=TEST_STEPS[mixer], batch=64, lr=3e-3)
    assert result["accuracy"] > 0.9, result

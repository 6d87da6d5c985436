"""A 2-layer model of every mixer learns multi-query associative recall on CPU (zoology-style MQAR)."""

import pytest
import torch

from eval.mqar import OPTIONS, STEPS, MQARTask, mqar_batch, train_mqar
from lm.mixers import MIXERS

TASK = MQARTask(vocab=32, pairs=4)
# Fewer steps than `lm eval mqar` takes where fewer already clear 90% by a wide margin, to keep the suite short
# (measured on Dec 3 2026, seed 0, see docs/mqar.md).
TEST_STEPS = {**STEPS, "deltanet": 200, "gated_deltanet": 200, "mesa": 150}


def test_mqar_batches_score_only_the_answers():
    inputs, targets = mqar_batch(TASK, 3, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (3, TASK.seq_len - 1)
    scored = targets != -100
    assert scored.sum(1).tolist() == [TASK.pairs] * 3
    # As in zoology, the answers are never inputs: after the context come the query keys, each followed by the
    # filler 0, which is never a key.
    assert (inputs[:, 8::2] > 0).all() and (inputs[:, 8::2] < 16).all() and (inputs[:, 9::2] == 0).all()
    assert (inputs[:, 0:8:2] > 0).all()
    for row in range(3):
        context = dict(zip(inputs[row, 0:8:2].tolist(), inputs[row, 1:8:2].tolist()))
        for pos in scored[row].nonzero().flatten().tolist():
            assert context[int(inputs[row, pos])] == int(targets[row, pos])  # the queried key's value


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_each_mixer_learns_mqar(mixer):
    # With `lm eval mqar`'s options: mLSTM with a short convolution (xLSTM 7B's block has none; docs/mqar.md).
    result = train_mqar(mixer, TASK, steps=TEST_STEPS[mixer], batch=64, lr=3e-3, mixer_options=OPTIONS.get(mixer))
    assert result["accuracy"] > 0.9, result

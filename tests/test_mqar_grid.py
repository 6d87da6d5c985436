"""MQAR in zoology's fixed-length format, and `lm eval mqar-grid` (eval/mqar_grid.py) on its quick grid: the
outputs, resuming, one cell at a time, bad input."""

import csv
import json

import pytest
import torch

import eval.mqar_grid as grid
from eval.mqar import MQARTask, mqar_batch
from lm.errors import UserError
from lm.mixers import MIXERS

ONE = sorted(MIXERS)[:1]  # one registered mixer, whichever: the grid's machinery is what is tested here


def test_fixed_length_batches_follow_zoology():
    task = MQARTask(vocab=64, pairs=5, length=24)
    inputs, targets = mqar_batch(task, 50, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (50, 24)
    spots, in_order = set(), 0
    for row in range(50):
        keys, values = inputs[row, 0:10:2].tolist(), inputs[row, 1:10:2].tolist()
        assert all(0 < k < 32 for k in keys) and all(32 <= v < 64 for v in values) and len(set(keys)) == 5
        tail, answers = inputs[row, 10:], targets[row, 10:]
        queried = tail[tail != 0].tolist()
        assert sorted(queried) == sorted(keys)  # every key queried once, the rest of the tail is the filler 0
        assert (targets[row, :10] == -100).all()
        assert ((answers != -100) == (tail != 0)).all()  # targets only at the queries: answers are never inputs
        context = dict(zip(keys, values))
        assert [context[k] for k in queried] == answers[answers != -100].tolist()
        spots.add(tuple((tail != 0).nonzero().flatten().tolist()))
        in_order += queried == keys
    assert in_order < 5 and len(spots) > 40  # a random order (the context's 1 time in 120) and random positions


def test_the_default_format_is_unchanged():
    task = MQARTask(vocab=32, pairs=4)
    assert task.seq_len == 16 and mqar_batch(task, 2, torch.Generator().manual_seed(0))[0].shape == (2, 15)


@pytest.mark.parametrize("task, message", [
    (dict(vocab=1024, pairs=64, length=128), "64 pairs and 64 queries need 2 x 64 \\+ 64 = 192 tokens; length is 128"),
    (dict(vocab=16, pairs=8, length=128), "8 pairs need 8 distinct keys; vocab 16 has 7"),
])
def test_tasks_that_do_not_fit_are_refused(task, message):
    with pytest.raises(ValueError, match=message):
        MQARTask(**task)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_quick_grid_writes_the_table_and_the_figure(tmp_path):
    """Every registered mixer, two processes, as the default grid runs."""
    out = tmp_path / "grid"
    rows = grid.mqar_grid(out=str(out), quick=True, processes=2)
    assert len(rows) == len(MIXERS) * 2
    table = read_csv(out / "grid.csv")
    assert {r["mixer"] for r in table} == set(MIXERS) and {r["pairs"] for r in table} == {"2", "6"}
    assert all(0 <= float(r["accuracy"]) <= 1 and int(r["state_floats"]) > 0 for r in table)
    md = (out / "grid.md").read_text()
    assert "| mixer | width | params | state floats / layer | 2 pairs | 6 pairs |" in md
    assert (out / "accuracy_vs_state.png").read_bytes()[:4] == b"\x89PNG"
    # A KV cache grows with the length, a recurrent state does not; attention-like mixers are found, not named.
    assert any(r["state_grows"] == "True" for r in table) and any(r["state_grows"] == "False" for r in table)
    header, body, images = grid.report_section(out)
    assert header[:4] == ["mixer", "width", "params", "state floats / layer"] and len(body) == len(MIXERS)
    assert images == [out / "accuracy_vs_state.png"]


def test_resume_runs_only_the_missing_cells(tmp_path, monkeypatch):
    out = tmp_path / "grid"
    grid.mqar_grid(out=str(out), mixers=ONE, quick=True, processes=1, cell=1)
    assert [p.name for p in (out / "cells").glob("*.json")] == [f"{ONE[0]}_d16_n6_lr0.003_s0.json"]
    assert len(read_csv(out / "grid.csv")) == 1
    real, ran = grid.run_cell, []
    monkeypatch.setattr(grid, "run_cell", lambda cell, path: ran.append(cell["name"]) or real(cell, path))
    grid.mqar_grid(out=str(out), mixers=ONE, quick=True, processes=1)
    assert ran == [f"{ONE[0]}_d16_n2_lr0.003_s0"]
    assert len(read_csv(out / "grid.csv")) == 2


def test_cell_minus_one_prints_the_number_of_cells(tmp_path, capsys):
    grid.mqar_grid(out=str(tmp_path / "grid"), quick=True, widths=[16], lrs=[1e-3, 3e-3], cell=-1)
    assert capsys.readouterr().out.strip() == str(len(MIXERS) * 2 * 2)
    assert not (tmp_path / "grid").exists()


def test_cells_of_another_grid_are_refused(tmp_path):
    out = tmp_path / "grid"
    grid.mqar_grid(out=str(out), mixers=ONE, quick=True, processes=1, cell=0)
    cell = next((out / "cells").glob("*.json"))
    row = json.loads(cell.read_text()) | {"steps": 99}
    cell.write_text(json.dumps(row))
    with pytest.raises(UserError, match="was run with other settings \\(steps\\): use another --out"):
        grid.mqar_grid(out=str(out), mixers=ONE, quick=True, processes=1)


@pytest.mark.parametrize("args, message", [
    (dict(mixers=["nope"]), "unknown mixers \\['nope'\\]"),
    (dict(pairs=[8, 64]), "--pairs 64: 64 pairs and 64 queries need .* length is 128"),
    (dict(cell=len(MIXERS) * 6), f"--cell {len(MIXERS) * 6} is out of range: this grid has {len(MIXERS) * 6} cells"),
    (dict(out="FILE"), "--out .*FILE is a file, not a directory"),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, args, message):
    (tmp_path / "FILE").write_text("")
    args = {"out": str(tmp_path / "grid"), **args}
    if args["out"] == "FILE":
        args["out"] = str(tmp_path / "FILE")
    with pytest.raises(UserError, match=message):
        grid.mqar_grid(**args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]

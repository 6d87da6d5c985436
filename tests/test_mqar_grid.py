"""MQAR in zoology's fixed-length format, and `lm eval mqar-grid` (lm/eval/mqar_grid.py) on its quick grid: the
outputs, resuming, one cell at a time, bad input."""

import csv
import json
import math

import pytest
import torch

import lm.eval.mqar_grid as grid
from lm.errors import UserError
from lm.eval.mqar import MQARTask, mqar_batch
from lm.mixers import MIXERS
from lm.report_section import read_section

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


def expected_state_floats(mixer: str, options: dict, d: int, heads: int, head_dim: int, length: int) -> int:
    """Floats one layer carries per sequence after `length` tokens, from each mixer's recurrence (its state's
    definition), with the dimensions its options give; not from the state the model returns. A short convolution of
    size c keeps its last c - 1 inputs."""
    o = MIXERS[mixer].check_options(options)
    conv = lambda channels: max(getattr(o, "conv_size", 0) - 1, 0) * channels
    if mixer in ("attention", "swa"):  # K and V of every kept token; a window keeps window - 1 of them
        kept = length if mixer == "attention" else min(length, o.window - 1)
        return 2 * (o.n_kv_heads or heads) * head_dim * kept
    if mixer in ("deltanet", "gated_deltanet", "gla"):  # S [K, V] per head; q, k, v convolved
        v = round(o.expand_v * head_dim)
        return heads * head_dim * v + conv(2 * heads * head_dim + heads * v)
    if mixer == "mesa":  # G [V, K] and H [K, K] per head; q, k (and v with conv_v) convolved
        v = round(o.expand_v * head_dim)
        return heads * (v + head_dim) * head_dim + conv(2 * heads * head_dim + (heads * v if o.conv_v else 0))
    if mixer == "mamba2":  # h [N, P] per head (N = head_dim, P = inner / heads); x, B, C convolved
        inner = round(o.expand * d)
        return inner * head_dim + conv(inner + 2 * o.n_groups * head_dim)
    if mixer == "hawk":  # h [W]; the input branch convolved
        width = heads * max(1, round(o.expand * d / heads))
        return width + conv(width)
    if mixer == "mlstm":  # C [K, V], n [K], m per head; the input convolved
        k, v = round(o.qk_dim_factor * d) // heads, round(o.v_dim_factor * d) // heads
        return heads * (k * v + k + 1) + conv(d)
    raise AssertionError(f"no state formula for mixer {mixer!r}: add one")


def test_quick_grid_writes_the_table_and_the_figure(tmp_path):
    """Every registered mixer, two processes, as the default grid runs. Each cell's state size is what its mixer's
    recurrence holds, and its row is its own: rerun alone in this process (one thread, as in the pool), a cell gives
    the same accuracy and loss to the last bit."""
    out = tmp_path / "grid"
    rows = grid.mqar_grid(out=str(out), quick=True, processes=2)
    assert len(rows) == len(MIXERS) * 2
    table = read_csv(out / "grid.csv")
    assert {r["mixer"] for r in table} == set(MIXERS) and {r["pairs"] for r in table} == {"2", "6"}
    width, length = grid.QUICK["widths"][0], grid.QUICK["length"]
    for row, r in zip(rows, table):
        assert (row["mixer"], row["pairs"]) == (r["mixer"], int(r["pairs"]))
        state, longer = (expected_state_floats(row["mixer"], row["options"], width, 2, width // 2, n)
                         for n in (length, 2 * length))
        assert int(r["state_floats"]) == row["state_floats"] == state, row["name"]
        assert r["state_grows"] == str(longer > state), row["name"]  # a KV cache
        per_batch = grid.QUICK["batch"] * row["pairs"]  # queries scored: whole batches until 2048
        correct = float(r["accuracy"]) * -(-2048 // per_batch) * per_batch
        assert 0 <= float(r["accuracy"]) <= 1 and correct == pytest.approx(round(correct), abs=1e-6), row["name"]
    md = (out / "grid.md").read_text()
    assert "| mixer | width | params | state floats / layer | 2 pairs | 6 pairs |" in md
    assert (out / "accuracy_vs_state.png").read_bytes()[:4] == b"\x89PNG"
    # A KV cache grows with the length, a recurrent state does not; attention-like mixers are found, not named.
    assert any(r["state_grows"] == "True" for r in table) and any(r["state_grows"] == "False" for r in table)
    heading, (header, body), images = read_section(out)  # what `lm compare report --sections` shows
    assert heading.startswith("MQAR grid") and header[:4] == ["mixer", "width", "params", "state floats / layer"]
    assert len(body) == len(MIXERS) and images == [out / "accuracy_vs_state.png"]
    row = next(r for r in rows if r["mixer"] == ONE[0] and r["pairs"] == 6)
    cell = {k: row[k] for k in ("name", "mixer", "options", "width", "pairs", "lr", "seed", "vocab", "length",
                                "steps", "batch")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = grid.run_cell(cell)
    finally:
        torch.set_num_threads(threads)
    assert (again["accuracy"], again["final_loss"]) == (row["accuracy"], row["final_loss"])


def test_a_cell_that_can_learn_beats_chance():
    """The grid's training and scoring can show learning: attention at the quick grid's size, with 300 steps at lr
    1e-2, recalls 41-49% of the queries (seeds 0-3; 1.2 s), where guessing a value scores 1/16."""
    cell = grid.grid_cells(["attention"], [16], [2], [1e-2], [0], vocab=32, length=24, steps=300, batch=16)[0]
    row = grid.run_cell(cell)
    assert row["accuracy"] > 4 / 16, row
    assert row["final_loss"] < 0.5 * math.log(32), row  # the untrained model's loss is about log(vocab)


def test_resume_runs_only_the_missing_cells(tmp_path, monkeypatch):
    out = tmp_path / "grid"
    grid.mqar_grid(out=str(out), mixers=ONE, quick=True, processes=1, cell=1)
    assert [p.name for p in (out / "cells").glob("*.json")] == [f"{ONE[0]}_d16_n6_lr0.003_s0.json"]
    assert len(read_csv(out / "grid.csv")) == 1
    real, ran = grid.run_cell, []
    monkeypatch.setattr(grid, "run_cell", lambda cell, path: ran.append(cell["name"]) or real(cell, path))
    resumed = grid.mqar_grid(out=str(out), mixers=ONE, quick=True, processes=1)
    assert ran == [f"{ONE[0]}_d16_n2_lr0.003_s0"]
    assert len(read_csv(out / "grid.csv")) == 2
    # The same cells run in one go give the same rows: a resumed grid is the grid.
    whole = grid.mqar_grid(out=str(tmp_path / "whole"), mixers=ONE, quick=True, processes=1)
    same = ("name", "accuracy", "final_loss", "params", "state_floats", "state_grows")
    assert [{k: r[k] for k in same} for r in resumed] == [{k: r[k] for k in same} for r in whole]


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

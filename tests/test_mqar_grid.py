"""MQAR in zoology's fixed-length format, and `lm eval mqar-grid` (lm/eval/mqar_grid.py) on its quick grid: the
outputs, resuming, one cell at a time, bad input."""

import csv
import json
import math
import random

import pytest
import torch

import lm.eval.mqar_grid as grid
from lm.eval.mqar import MQARTask, mqar_batch
from lm.mixers import MIXERS
from lm.util.errors import UserError
from lm.util.report_section import read_section

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
    if mixer in ("deltanet", "gated_deltanet", "gla", "kda"):  # S [K, V] per head; q, k, v convolved
        v = round(o.expand_v * head_dim)
        return heads * head_dim * v + conv(2 * heads * head_dim + heads * v)
    if mixer == "gated_deltaproduct":  # S [K, V] per head; q, and each Householder step's k and v, convolved
        v, n = round(o.expand_v * head_dim), o.householder_steps
        return heads * head_dim * v + conv(heads * head_dim + n * heads * (head_dim + v))
    if mixer == "precond_gated_deltanet":  # S [K, V] and the preconditioner's A [K] per head; q, k, v convolved
        v = round(o.expand_v * head_dim)
        return heads * head_dim * (v + 1) + conv(2 * heads * head_dim + heads * v)
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


@pytest.fixture(scope="module")
def quick_grid(tmp_path_factory):
    """The quick grid of every registered mixer, two processes, as the default grid runs: (out, rows)."""
    out = tmp_path_factory.mktemp("quick") / "grid"
    return out, grid.mqar_grid(out=str(out), quick=True, processes=2)


def test_quick_grid_writes_the_table_and_the_figure(quick_grid):
    """Every registered mixer, two processes, as the default grid runs (zoology's protocol). Each cell's state size
    is what its mixer's recurrence holds plus the convolution before it, and its row is its own: rerun alone in this
    process (one thread, as in the pool), a cell gives the same accuracy and loss to the last bit."""
    out, rows = quick_grid
    assert len(rows) == len(MIXERS) * 2
    table = read_csv(out / "grid.csv")
    assert {r["mixer"] for r in table} == set(MIXERS) and {r["pairs"] for r in table} == {"2", "6"}
    width, length = grid.QUICK["widths"][0], grid.QUICK["length"]
    for row, r in zip(rows, table):
        assert (row["mixer"], row["pairs"]) == (r["mixer"], int(r["pairs"]))
        assert (row["conv"], row["mlp"], row["gaps"]) == (3, False, "power")
        state, longer = (expected_state_floats(row["mixer"], row["options"], width, 2, width // 2, n)
                         + (row["conv"] - 1) * width for n in (length, 2 * length))
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
                                "steps", "batch", *grid.LM_PROTOCOL)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = grid.run_cell(cell)
    finally:
        torch.set_num_threads(threads)
    assert (again["accuracy"], again["final_loss"]) == (row["accuracy"], row["final_loss"])


def test_a_cell_that_can_learn_beats_chance(one_thread):
    """The grid's training and scoring can show learning: attention at the quick grid's size, with 600 steps at lr
    1e-2, recalls 47.9-54.0% of the queries, final loss 0.63-1.09 (seeds 0-7, one thread; 2.7 s), where guessing a
    value scores 1/16 and the untrained model's loss is about log(vocab) = 3.47. (With 300 steps: 26.9-51.9%, loss
    0.80-1.94: seed 4 failed both bounds.)"""
    cell = grid.grid_cells(["attention"], [16], [2], [1e-2], [0], vocab=32, length=24, steps=600, batch=16)[0]
    row = grid.run_cell(cell)
    assert row["accuracy"] > 4 / 16, row
    assert row["final_loss"] < 0.5 * math.log(32), row  # 1.73


def test_resume_runs_only_the_missing_cells_and_refuses_another_grids(tmp_path, monkeypatch, quick_grid, one_thread,
                                                                      capsys):
    out = tmp_path / "grid"
    grid.mqar_grid(out=str(out), mixers=ONE, quick=True, processes=1, cell=1)
    assert [p.name for p in (out / "cells").glob("*.json")] == [f"{ONE[0]}_d16_n6_lr0.003_s0.json"]
    assert len(read_csv(out / "grid.csv")) == 1
    real, ran = grid.run_cell, []
    monkeypatch.setattr(grid, "run_cell", lambda cell, path: ran.append(cell["name"]) or real(cell, path))
    resumed = grid.mqar_grid(out=str(out), mixers=ONE, quick=True, processes=1)
    assert ran == [f"{ONE[0]}_d16_n2_lr0.003_s0"]
    assert len(read_csv(out / "grid.csv")) == 2
    assert f"cells done; wrote grid.csv, grid.md and accuracy_vs_state.png in {out}\n" in capsys.readouterr().err
    # The same cells run in one go (the quick grid's, each in a process of one thread; these in this one, on one
    # thread) give the same rows: a resumed grid is the grid.
    same = ("name", "accuracy", "final_loss", "params", "state_floats", "state_grows")
    whole = [r for r in quick_grid[1] if r["mixer"] == ONE[0]]
    assert [{k: r[k] for k in same} for r in resumed] == [{k: r[k] for k in same} for r in whole]
    # A cell of another grid (other settings under the same name) is refused, not mixed into the table.
    cell = next((out / "cells").glob("*.json"))
    cell.write_text(json.dumps(json.loads(cell.read_text()) | {"steps": 99}))
    with pytest.raises(UserError, match="was run with other settings \\(steps\\): use another --out"):
        grid.mqar_grid(out=str(out), mixers=ONE, quick=True, processes=1)


def test_cell_minus_one_prints_the_number_of_cells(tmp_path, capsys):
    grid.mqar_grid(out=str(tmp_path / "grid"), quick=True, widths=[16], lrs=[1e-3, 3e-3], cell=-1)
    assert capsys.readouterr().out.strip() == str(len(MIXERS) * 2 * 2)
    assert not (tmp_path / "grid").exists()


def test_mixer_options_replace_the_probe_options_in_the_cells_model():
    """--mixer_options (Mesa's output norm from 1, as before issue "Science") reach the model a cell trains."""
    task = MQARTask(vocab=32, pairs=2, length=24)
    default, chosen = (grid.grid_cells(["mesa"], [16], [2], [1e-3], [0], 32, 24, 20, 16, mixer_options=options)[0]
                       for options in (None, {"mesa": {"norm_init": 1.0}}))
    assert chosen["options"] == {"norm_init": 1.0} and default["options"] == {}
    weights = [grid.build_model(c, task).blocks[0].mixer.norm.weight for c in (default, chosen)]
    assert (weights[0] == MIXERS["mesa"].Options().norm_init).all() and (weights[1] == 1.0).all()


@pytest.mark.parametrize("args, message", [
    (dict(mixers=["nope"]), "unknown mixers \\['nope'\\]"),
    (dict(pairs=[8, 64]), "--pairs 64: 64 pairs need 64 distinct keys; vocab 128 has 63"),
    (dict(pairs=[8, 16], length=40), "--pairs 16: .* length is 40"),
    (dict(cell=len(MIXERS) * 8), f"--cell {len(MIXERS) * 8} is out of range: this grid has {len(MIXERS) * 8} cells"),
    (dict(out="FILE"), "--out .*FILE is a file, not a directory"),
    (dict(mixers=["mesa"], mixer_options={"mesa": {"nope": 1}}), "--mixer_options: mixer 'mesa' has no option 'nope'"),
    (dict(mixers=["mesa"], mixer_options={"gla": {}}), "--mixer_options names 'gla', which is not among --mixers"),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, args, message):
    (tmp_path / "FILE").write_text("")
    args = {"out": str(tmp_path / "grid"), **args}
    if args["out"] == "FILE":
        args["out"] = str(tmp_path / "FILE")
    with pytest.raises(UserError, match=message):
        grid.mqar_grid(**args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def test_power_law_gaps_follow_zoology():
    """Zoology's data/multiquery_ar.py: query j at 2 g_j after the context, the n gaps distinct, each drawn with
    weight (g + 1)^(a - 1); the positions between hold random tokens; every key is queried once, answered by its
    value."""
    task = MQARTask(vocab=64, pairs=4, length=40, gaps="power", power_a=0.01, random_fill=True)
    inputs, targets = mqar_batch(task, 4000, torch.Generator().manual_seed(0))
    space = (40 - 8) // 2
    counts = torch.zeros(space)
    for row in range(4000):
        where = (targets[row] != -100).nonzero().flatten()
        gaps = (where - 8) // 2
        assert ((where - 8) % 2 == 0).all() and len(set(gaps.tolist())) == 4
        keys, values = inputs[row, 0:8:2].tolist(), inputs[row, 1:8:2].tolist()
        assert sorted(inputs[row, where].tolist()) == sorted(keys)
        assert [dict(zip(keys, values))[k] for k in inputs[row, where].tolist()] == targets[row, where].tolist()
        counts[gaps] += 1
    # Against 4 draws without replacement, one at a time, with weights (g + 1)^(a - 1) (Python's random): how often
    # each gap is taken. Most queries come soon after the context, as zoology wants.
    draws, expected = random.Random(1), torch.zeros(space)
    for _ in range(4000):
        left = list(range(space))
        for _ in range(4):
            g = draws.choices(left, weights=[(x + 1) ** (0.01 - 1) for x in left])[0]
            left.remove(g)
            expected[g] += 1
    assert (counts / 4000 - expected / 4000).abs().max() < 0.04, (counts / 4000, expected / 4000)
    assert counts[:4].sum() / counts.sum() > 0.45 and counts[space // 2:].sum() > 0
    between = (targets == -100)
    between[:, :8] = False
    filler = inputs[between]
    assert (filler != 0).float().mean() > 0.9 and len(filler.unique()) > 50  # random tokens, not the filler 0
    uniform, _ = mqar_batch(MQARTask(vocab=64, pairs=4, length=40), 4000, torch.Generator().manual_seed(0))
    assert (uniform[:, 8:] == 0).float().mean() > 0.8  # lm's own protocol: filler between the queries


def test_power_law_gaps_need_room_for_every_query():
    with pytest.raises(ValueError, match="need a length of 2 x 8 \\+ 2 x 8 = 32 or more \\(got 24\\)"):
        MQARTask(vocab=64, pairs=8, length=24, gaps="power")


def test_the_zoology_protocol_builds_zoology_blocks_and_stops_early(tmp_path):
    """No MLP (the SwiGLU holds no weights), a convolution of 3 before each mixer, cosine decay; with early_stop at
    1% the cell stops at the first check."""
    cell = grid.grid_cells(["attention"], [16], [2], [1e-2], [0], vocab=32, length=24, steps=200, batch=16,
                           protocol={**grid.ZOOLOGY, "early_stop": 0.01})[0]
    task = MQARTask(vocab=32, pairs=2, length=24, gaps="power", random_fill=True)
    model = grid.build_model(cell, task)
    lm_model = grid.build_model({**cell, **grid.LM_PROTOCOL}, task)
    for block, lm_block in zip(model.blocks, lm_model.blocks):
        assert sum(p.numel() for p in block.mlp.parameters()) == 0
        assert isinstance(block.mixer, grid.ConvThenMixer) and block.mixer.conv.weight.shape == (16, 1, 3)
        assert sum(p.numel() for p in lm_block.mlp.parameters()) == 3 * 16 * 32
    row = grid.run_cell(cell)
    assert row["steps_run"] == grid.EARLY_STOP_EVERY and row["mlp"] is False and row["gaps"] == "power"
    never = grid.run_cell({**cell, "steps": 60, "early_stop": None})
    assert never["steps_run"] == 60


def test_the_conv_before_the_mixer_carries_its_state():
    """A sequence fed in two pieces, the state carried, gives one call's output (the wrapper is a mixer)."""
    torch.manual_seed(0)
    mixer = grid.ConvThenMixer(MIXERS["attention"](16, 2, 8, 0), 16, 3)
    x = torch.randn(2, 11, 16)
    whole, _ = mixer(x)
    first, state = mixer(x[:, :5])
    second, _ = mixer(x[:, 5:], state)
    torch.testing.assert_close(torch.cat([first, second], 1), whole)


def test_protocol_options_are_checked(tmp_path):
    with pytest.raises(UserError, match="--protocol must be lm or zoology"):
        grid.mqar_grid(out=str(tmp_path / "g"), protocol="nope")
    with pytest.raises(UserError, match="--schedule must be one_cycle or cosine"):
        grid.mqar_grid(out=str(tmp_path / "g"), schedule="linear")
    with pytest.raises(UserError, match="--pairs 40: power-law gaps"):
        grid.mqar_grid(out=str(tmp_path / "g"), protocol="zoology", pairs=[40], length=128)
    assert not (tmp_path / "g").exists()

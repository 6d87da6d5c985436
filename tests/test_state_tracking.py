"""`lm eval state-tracking` (lm/eval/state_tracking.py): the words' running products against permutations followed point
by point, the probe separating a delta rule with beta in [0, 2] from one in [0, 1] on parity, and a rerun that trains
only what is missing. The full probe's figures are in docs/state_tracking.md."""

import itertools
import json

import pytest
import torch

from lm.eval.state_tracking import TASKS, group, parse_model, state_tracking, train_one, words
from lm.util.errors import UserError


@pytest.mark.parametrize("task", list(TASKS))
def test_running_products_follow_the_permutations_point_by_point(task):
    # Independent of the multiplication table: each point's image is carried through the word's permutations in order
    # (x_1 first), and the product is the permutation those images spell.
    n = TASKS[task]
    _, elements = group(n)
    x, products = words(task, 16, 9, torch.Generator().manual_seed(0))
    for b in range(16):
        images = list(range(n))
        for t in range(9):
            images = [elements[int(x[b, t])][i] for i in images]
            assert elements[int(products[b, t])] == tuple(images)


def test_parity_is_the_count_of_swaps_and_s3_is_not_abelian():
    x, products = words("parity", 8, 12, torch.Generator().manual_seed(1))
    _, elements = group(2)
    swaps = torch.tensor([[elements[int(e)] == (1, 0) for e in row] for row in x]).long()
    assert torch.equal(torch.tensor([[elements[int(p)] == (1, 0) for p in row] for row in products]).long(),
                       swaps.cumsum(1) % 2)
    table, _ = group(3)
    assert any(table[a, b] != table[b, a] for a, b in itertools.product(range(6), repeat=2))


def test_variants_parse_as_json_and_are_checked():
    assert parse_model("deltanet@beta_range=[0,2]") == ("deltanet", {"beta_range": [0, 2]})
    assert parse_model("gated_deltaproduct@householder_steps=3@beta_range=[0,2]") == (
        "gated_deltaproduct", {"householder_steps": 3, "beta_range": [0, 2]})
    with pytest.raises(UserError, match="beta_range"):
        parse_model("deltanet@beta_range=[0,3]")
    with pytest.raises(UserError, match="not OPTION=VALUE"):
        parse_model("deltanet@beta_range")


def test_negative_eigenvalues_solve_parity_where_beta_in_0_1_cannot(one_thread):
    # Words of 8, 500 steps, one layer of width 16. Over seeds 0-8 (measured Dec 6), beta in [0, 2] was 100% right at
    # the training length on every seed (2x: 70-90%), beta in [0, 1] 68-90% (2x: 46-56%, chance is 50%).
    shape = dict(length=8, steps=500, batch=32, lr=1e-2, d_model=16, n_layers=1, n_heads=1, head_dim=16,
                 test_words=256, multiples=(1, 2))
    negative = train_one("parity", "deltanet@beta_range=[0,2]", 0, **shape)["accuracy"]
    positive = train_one("parity", "deltanet", 0, **shape)["accuracy"]
    assert negative["1"] >= 0.97 and negative["2"] >= 0.65, negative
    assert positive["1"] <= 0.95 and positive["2"] <= 0.62, positive


def test_outputs_and_a_rerun_trains_only_what_is_missing(tmp_path, one_thread, capsys):
    shape = dict(tasks=["parity"], seeds=[0], length=4, steps=3, batch=4, d_model=8, n_heads=1, head_dim=8,
                 test_words=8, multiples=[1, 2], workers=1, out=str(tmp_path))
    first = state_tracking(models=["deltanet"], **shape)
    assert {p.name for p in tmp_path.iterdir()} == {"runs", "results.json", "state_tracking.md", "state_tracking.png"}
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["model"] for r in results["runs"]] == ["deltanet"] and set(results["runs"][0]["accuracy"]) == {"1", "2"}
    assert "deltanet" in (tmp_path / "state_tracking.md").read_text()
    capsys.readouterr()

    again = state_tracking(models=["deltanet", "mesa"], **shape)
    out = capsys.readouterr().out
    assert "1 of 2 runs already done" in out and "parity/deltanet/s0:" not in out and "parity/mesa/s0:" in out
    assert again[0] == first[0]  # the saved row, not a retrained one (its seconds would differ)

    changed = state_tracking(models=["deltanet"], **{**shape, "steps": 4})
    assert "already done" not in capsys.readouterr().out and changed[0]["steps"] == 4

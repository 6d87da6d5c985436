"""What `lm compare ladder` may claim, tested on synthetic ladders: no training, run results drawn from known laws with
known noise (tests/synthetic_ladder.py). Verdicts at measured compute find a crossing inside the measured range, and
one beyond it is only read as a labelled extrapolation; a verdict never names the architecture the point estimates put
behind; the held-out error matches a miss built into the largest rung; E at its bound is "not identified"; every rung
sweeps its lr around the one carried up, widened where the best lies at an end, and the rule over all rungs finds
the slope it was built with; a "+" pattern trains; `choose:` takes the fewest CG steps within the reference's spread;
an iso-FLOP ladder's optimum at each budget, and the architectures compared there, each at its own best size."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from synthetic_ladder import Law, synthetic, truth

import lm.compare.ladder as ladder_module
from lm.compare.ladder_verdicts import RungMean, compare, extrapolated

SEEDS = 3


def rungs_of(curve, computes, sigma: float, rng) -> list[RungMean]:
    """Rung means of SEEDS seeds drawn around curve(C) with relative noise sigma."""
    means = []
    for i, c in enumerate(computes):
        losses = curve(c) * np.exp(sigma * rng.standard_normal(SEEDS))
        means.append(RungMean(f"r{i}", c, float(losses.mean()), float(losses.var(ddof=1)), SEEDS))
    return means


# Two curves that cross at 1e11 FLOPs (the second is steeper), measured at 5 rungs from 1e9 to 1e13.
CROSS = 1e11
FIRST = lambda c: 2.0 + 30 * c ** -0.1  # noqa: E731
SECOND = lambda c: 1.8 + (FIRST(CROSS) - 1.8) * (c / CROSS) ** -0.2  # noqa: E731
COMPUTES = np.logspace(9, 13, 5)


def test_a_crossing_inside_the_measured_range_is_found_where_it_was_built():
    """The first is lower below 1e11, the second above: the verdict names each over its own side, cannot tell near the
    crossing, and the point estimates cross within a factor 2 of 1e11."""
    rng = np.random.default_rng(0)
    found = compare(("one", "two"), rungs_of(FIRST, COMPUTES, 0.003, rng), rungs_of(SECOND, COMPUTES, 0.003, rng),
                    0.9)
    sides = [s for s, _, _ in found["segments"]]
    assert sides[0] == -1 and sides[-1] == 1 and 0 in sides, found["verdict"]
    assert found["verdict"].startswith("one lower than two from 1.000e9") and "cannot tell from" in found["verdict"]
    assert "two lower than one from" in found["verdict"] and found["verdict"].endswith("to 1.000e13")
    (crossing,) = found["crossings"]
    assert abs(math.log(crossing / CROSS)) < math.log(2)
    _, start, end = next(s for s in found["segments"] if s[0] == 0)
    assert start <= crossing <= end


def test_a_crossing_beyond_the_largest_run_is_only_an_extrapolation():
    """Measured only up to 1e10, the first is lower over the whole range and nothing crosses there; at 1e13 only the
    fitted curves speak, labelled with how far past the largest run they are read and with their held-out errors, and
    with no share of replicates."""
    rng = np.random.default_rng(1)
    first, second = (rungs_of(curve, COMPUTES[:2], 0.003, rng) for curve in (FIRST, SECOND))
    found = compare(("one", "two"), first, second, 0.9)
    assert found["verdict"] == "one lower than two from 1.000e9 to 1.000e10" and not found["crossings"]

    def fit(curve, error):
        e, a, alpha = (2.0, 30.0, 0.1) if curve is FIRST else (1.8, (FIRST(CROSS) - 1.8) * CROSS ** 0.2, 0.2)
        return {"theta": [e, math.log(a), alpha], "held_out": {"largest": error}}

    far = extrapolated(("one", "two"), (fit(FIRST, 0.01), fit(SECOND, -0.02)), 1e13, found["range"], (1e10, 1e10))
    assert far["label"] == "extrapolated, 1,000x past the largest run (one 1,000x, two 1,000x)"
    gap = FIRST(1e13) - SECOND(1e13)
    assert far["gap"] == pytest.approx(gap, rel=1e-9) and "%" not in far["reading"]
    assert far["reading"] == f"two's curve lower by {gap:.3f} nats, more than the held-out errors (0.010 + 0.020 nats)"
    wide = extrapolated(("one", "two"), (fit(FIRST, 0.4), fit(SECOND, 0.4)), 1e13, found["range"], (1e10, 1e10))
    assert wide["reading"].startswith("cannot tell: the curves' gap")
    assert extrapolated(("one", "two"), (fit(FIRST, 0), fit(SECOND, 0)), 1e9, found["range"], (1e10, 1e10)) is None


def test_a_verdict_never_names_the_one_the_point_estimates_put_behind():
    """Near-equal curves with noise: wherever a verdict names one lower, its interval there excludes 0 and its point gap
    says the same; and at a single matched compute (a head-to-head) too."""
    rng = np.random.default_rng(2)
    named = 0
    for _ in range(200):
        found = compare(("one", "two"), rungs_of(FIRST, COMPUTES, 0.01, rng),
                        rungs_of(lambda c: FIRST(c) * 1.004, COMPUTES, 0.01, rng), 0.9)
        for gap in found["gaps"]:
            side = next(s for s, start, end in found["segments"] if start <= gap["compute"] <= end)
            named += side != 0
            assert side == 0 or (np.sign(gap["gap"]) == side and np.sign(gap["low"]) == np.sign(gap["high"]) == side)
    assert named > 10  # both kinds are seen
    one = compare(("a", "b"), [RungMean("x", 1e12, 2.0, 1e-4, 3)], [RungMean("x", 1.01e12, 2.1, 1e-4, 3)], 0.9)
    assert one["verdict"] == "a lower than b at 1.005e12"


# The synthetic ladder, measured from about 1e11 to 1.5e12 FLOPs: attention and hawk cross at 4e11, inside that
# range, and hawk's largest rung lies 5% above its law; attention and the hybrid cross at 1e14, beyond it, and the
# hybrid's law is a pure power law (E = 0). Attention's best lr falls with size as params^-0.5, and its sweep starts
# 8x above it.
LR_SLOPE = -0.5
OFFSET = 0.05
ATTENTION = lambda c: 1.5 + 4e3 * c ** -0.35  # noqa: E731
LAWS = {
    "attention": Law(ATTENTION, lambda n: 2e-2 * (n / 1e5) ** LR_SLOPE, 0.001),
    "hawk": Law(lambda c: 1.6 + (ATTENTION(4e11) - 1.6) * (c / 4e11) ** -0.1, sigma=0.001, offsets={"330k": OFFSET}),
    "gated_deltanet_attention": Law(lambda c: ATTENTION(1e14) * (c / 1e14) ** -0.05, sigma=0.003),
}


def write_base(tmp: Path, data: str, lr: float) -> None:
    """The synthetic ladders' base run config: tiny, one process, no validation until the last step."""
    (tmp / "base.yaml").write_text(yaml.safe_dump({
        "seed": 0, "model": {"vocab_size": 512, "max_seq_len": 32},
        "data": {"path": data, "seq_len": 32, "micro_batch": 4, "global_batch": 4, "num_workers": 0},
        "optim": {"lr": lr, "warmup_steps": 5},
        "trainer": {"val_every": 10**6, "ckpt_every": 10**6, "keep_last": 1, "log_every": 5, "progress_bar": False},
        "strategy": {"accelerator": "cpu", "devices": 1}}))


@pytest.fixture(scope="module")
def synthetic_ladder(kjv_data, tmp_path_factory) -> tuple:
    tmp = tmp_path_factory.mktemp("synthetic")
    write_base(tmp, kjv_data, lr=3.0e-3)
    (tmp / "ladder.yaml").write_text(yaml.safe_dump({
        "archs": ["attention", "hawk", "gated_deltanet+attention"], "rungs": [1.0e5, 1.5e5, 2.2e5, 3.3e5],
        "base": "base.yaml", "tokens_per_param": 2, "seeds": [1, 2, 3], "bootstrap": 200, "target_compute": 1e14,
        "lr": {"start": {"attention": 0.16, "hawk": 1e-2, "gated_deltanet+attention": 1e-2}, "factors": [0.5, 1, 2],
               "against": "params"}}))
    patch = pytest.MonkeyPatch()
    patch.setattr(ladder_module, "train_run", synthetic(LAWS))
    try:
        ladder_module.ladder(str(tmp / "ladder.yaml"), out=str(tmp / "out"), workers=1)
    finally:
        patch.undo()
    report = tmp / "out" / "report"
    return json.loads((report / "fits.json").read_text()), (report / "ladder.md").read_text()


def table_row(markdown: str, first: str) -> list[str]:
    return next(line.split(" | ") for line in markdown.splitlines() if line.startswith(f"| {first} |"))


def test_the_synthetic_ladders_verdicts_say_only_what_its_runs_show(synthetic_ladder):
    fits, report = synthetic_ladder
    # attention and hawk cross where their laws do, inside the range both were measured over.
    c = np.geomspace(1e9, 1e13, 4001)
    built = c[np.argmin(np.abs(LAWS["attention"].curve(c) - LAWS["hawk"].curve(c)))]
    record = next(v for v in fits["verdicts"] if v["pair"] == ["attention", "hawk"])
    (crossing,) = record["crossings"]
    assert record["range"][0] < built < record["range"][1] and abs(math.log(crossing / built)) < math.log(1.5)
    row = table_row(report, "attention / hawk")
    assert "hawk lower than attention from" in row[2] and "attention lower than hawk from" in row[2]
    # attention and the hybrid: attention lower wherever both have runs, their curves crossing only beyond.
    row = table_row(report, "attention / gated_deltanet_attention")
    assert row[2].startswith("attention lower than gated_deltanet_attention from") and ";" not in row[2]
    assert row[3].startswith("none inside")
    (beyond,) = [line for line in report.split("## Beyond")[1].splitlines()
                 if line.startswith("| attention / gated_deltanet_attention |")]
    assert "extrapolated, " in beyond and "x past the largest run" in beyond
    verdicts = [line for line in report.split("## Fits judged")[0].splitlines() if " / " in line.split(" | ")[0]]
    assert len(verdicts) > 6 and not [line for line in verdicts if "%" in line]  # no share of replicates


def test_the_held_out_error_matches_the_miss_built_into_the_largest_rung(synthetic_ladder):
    """Hawk's largest rung lies OFFSET (5%) above its law: predicted from the three rungs below, the error is -5% of
    the loss there, to within the noise of the seeds' means (sigma 0.1% / sqrt 3) carried up by the fit."""
    fits, _ = synthetic_ladder
    rows = [p for p in fits["points"]["hawk"] if p["rung"] == "330k"]
    missed = -OFFSET * np.mean([LAWS["hawk"].curve(p["compute"]) for p in rows])
    held = fits["fits"]["hawk"]["held_out"]
    assert held["largest"] == pytest.approx(missed, abs=0.02), (held, missed)
    assert abs(fits["fits"]["attention"]["held_out"]["largest"]) < 0.02  # a law with no miss: about 0


def test_e_at_its_bound_is_not_identified(synthetic_ladder):
    fits, report = synthetic_ladder
    assert not fits["fits"]["gated_deltanet_attention"]["E_identified"]
    assert "not identified (" in table_row(report, "gated_deltanet_attention")[4]


def test_every_rung_sweeps_the_lr_carried_up_and_the_rule_finds_its_slope(synthetic_ladder):
    """Attention's sweep starts 8x above its best lr: the first rung widens downwards until the best lies inside;
    each larger rung sweeps x0.5, x1, x2 around the best lr of the rung below; no rung ends at an edge; the rule over
    all four rungs finds the slope -0.5 the law was built with."""
    fits, _ = synthetic_ladder
    rule = fits["lr_rules"]["attention"]
    sweeps = rule["sweeps"]
    assert [s["rung"] for s in sweeps] == ["100k", "150k", "220k", "330k"]
    assert len(sweeps[0]["losses"]) > 3 and min(map(float, sweeps[0]["losses"])) < 0.16 * 0.5
    for below, above in zip(sweeps, sweeps[1:]):
        assert above["first"] == pytest.approx([float(f"{below['best_lr'] * f:.3g}") for f in (0.5, 1, 2)], rel=1e-9)
    assert all(s["found_by"] == "parabola vertex" for r in fits["lr_rules"].values() for s in r["sweeps"])
    slope = float(rule["rule"].split("params^")[1].split(" ")[0])
    assert slope == pytest.approx(LR_SLOPE, abs=0.15)
    for point in fits["points"]["attention"]:  # the seeds ran at their rung's best lr of the sweep
        sweep = next(s for s in sweeps if s["rung"] == point["rung"])
        assert point["lr"] == sweep["best_grid_lr"]


def test_choose_takes_the_fewest_cg_steps_shown_within_the_tolerance(kjv_data, tmp_path, monkeypatch, capsys):
    """Mesa's loss at each CG-step count, as built: 2 steps 3% above 30, 4 steps 0.1% above, 8 exactly at it, each
    seed's noise 0.2%. With a tolerance of 0.02 nats the choice is 4: the upper end of the 90% Welch interval of 2
    steps minus 30 lies far above 0.02, of 4 below it (each interval equal to scipy's Welch interval of the runs'
    losses). The architecture written mesa@cg_steps=chosen trains as mesa@cg_steps=4 at one matched compute; chosen at
    the ladder's largest rung, the report says it was made there."""
    from scipy.stats import ttest_ind

    laws = {f"mesa@cg_steps={k}": Law(lambda c, k=k: 3.0 * {2: 1.03, 4: 1.001}.get(k, 1.0), sigma=0.002)
            for k in (2, 4, 8, 30)}
    laws["hawk"] = Law(lambda c: 2.9, sigma=0.002)  # lower than Mesa: the verdict names it
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "seed": 0, "model": {"vocab_size": 512, "max_seq_len": 32},
        "data": {"path": kjv_data, "seq_len": 32, "micro_batch": 4, "global_batch": 4, "num_workers": 0},
        "trainer": {"val_every": 10**6, "progress_bar": False}, "strategy": {"accelerator": "cpu", "devices": 1}}))
    (tmp_path / "ladder.yaml").write_text(yaml.safe_dump({
        "archs": ["mesa@cg_steps=chosen", "hawk"], "rungs": [1.0e5], "budgets": [2e10], "base": "base.yaml",
        "tokens_per_param": 1, "bootstrap": 20,
        "seeds": [1, 2], "lr": {"start": 1e-2, "factors": [0.5, 1, 2]},
        "choose": {"arch": "mesa", "option": "cg_steps", "values": [30, 8, 4, 2], "reference": 30, "rung": 1.0e5,
                   "lr": 1e-2, "seeds": [0, 1, 2], "tolerance": 0.02}}))
    monkeypatch.setattr(ladder_module, "train_run", synthetic(laws))
    ladder_module.ladder(str(tmp_path / "ladder.yaml"), out=str(tmp_path / "out"), workers=1)
    err = capsys.readouterr().err
    assert "choose: cg_steps 4 for mesa" in err
    fits = json.loads((tmp_path / "out" / "report" / "fits.json").read_text())
    losses = {value: [truth(laws[f"mesa@cg_steps={value}"], 0, 1, 1e-2, "", p.name)
                      for p in sorted((tmp_path / "out" / "runs").glob(f"mesa@cg_steps={value}-100k-lr*"))]
              for value in (2, 4, 8, 30)}
    rows = {r["value"]: r for r in fits["choice"]["rows"]}
    for value in (2, 4, 8):
        welch = ttest_ind(losses[value], losses[30], equal_var=False).confidence_interval(0.9)
        assert rows[value]["interval"] == pytest.approx([welch.low, welch.high], rel=1e-9)
    assert rows[2]["interval"][1] > 0.02 > rows[4]["interval"][1] and not rows[2]["within"] and rows[4]["within"]
    assert [r["value"] for r in fits["choice"]["rows"]] == [2, 4, 8, 30] and fits["choice"]["chosen"] == 4
    assert fits["choice"]["confirmed"]
    report = (tmp_path / "out" / "report" / "ladder.md").read_text()
    assert "It was made at the 100k rung, the largest that uses it." in report
    assert set(fits["points"]) == {"mesa@cg_steps=4", "hawk"}
    assert len({p["compute"] for rows in fits["points"].values() for p in rows}) == 2  # one budget, matched within 2%
    row = table_row(report, "mesa@cg_steps=4 / hawk")
    assert row[2].startswith("hawk lower than mesa@cg_steps=4 at ")


def optimal_size(budget: float) -> float:
    """The N that minimises 1.7 + 400 N^-0.34 + 410 D^-0.28 at C = 6 N D = budget (Chinchilla's law)."""
    return ((0.34 * 400) / (0.28 * 410 * (budget / 6) ** -0.28)) ** (1 / 0.62)


def iso_rows(scale: float, sizes, rng, budgets=(1e16, 1e17, 1e18)) -> list[dict]:
    """Runs of an iso-FLOP ladder: at each budget, sizes x its optimal size, 3 seeds with relative noise 0.2%, losses
    from Chinchilla's L(N, D) times `scale`."""
    rows = []
    for budget in budgets:
        for n in optimal_size(budget) * np.asarray(sizes):
            d = budget / (6 * n)
            law = scale * (1.7 + 400 * n ** -0.34 + 410 * d ** -0.28)
            rows += [{"budget": budget, "params": n, "tokens": d, "compute": budget, "rung": f"{n:g}", "seed": seed,
                      "loss": law * math.exp(0.002 * rng.standard_normal())} for seed in range(3)]
    return rows


def test_each_budgets_optimum_and_the_comparison_at_it():
    """Each budget's parabola finds the compute-optimal size within 10% (its own bias: a parabola in log N only
    approximates the law), inside an interval of a few percent; at each budget an architecture whose losses are 2%
    higher is behind at its own best size, one 0.05% higher cannot be told apart, and one whose sizes all lie below
    the optimum has no identified optimum, so no verdict."""
    from lm.compare.ladder_report import isoflop, optimum_rows

    rng = np.random.default_rng(0)
    around, below = np.geomspace(0.3, 3, 5), np.geomspace(0.05, 0.3, 5)
    found = {name: isoflop(iso_rows(scale, sizes, rng), 0.9, 400, i)[0]
             for i, (name, scale, sizes) in enumerate([("one", 1.0, around), ("two", 1.02, around),
                                                       ("three", 1.0005, around), ("low", 1.0, below)])}
    for p in found["one"]:
        assert abs(math.log(p["params_opt"] / optimal_size(p["budget"]))) < math.log(1.1), p
        lo, hi = p["params_interval"]
        assert lo < p["params_opt"] < hi < 1.1 * lo and p["identified"]
    assert not any(p["identified"] for p in found["low"])
    _, verdicts = optimum_rows(found, 0.9)
    said = {(row[0], row[1]): row[3] for row in verdicts}
    for budget in ("1.000e16", "1.000e17", "1.000e18"):
        assert said["one / two", budget] == "one lower, each at its own best size"
        assert said["two / three", budget] == "three lower, each at its own best size"
        assert said["one / three", budget] == "cannot tell"
        assert said["one / low", budget].startswith("cannot tell: low's optimum is not identified")


def test_the_interval_between_rungs_is_never_narrower_than_at_the_wider_rung():
    """Two architectures at the same five rungs, 3 seeds each: at every compute read between two rungs, the gap's
    interval is at least as wide as at either rung, and wider by the lines' errors where the curves bend."""
    from lm.compare.ladder_verdicts import readings

    rng = np.random.default_rng(5)
    for _ in range(20):
        first, second = rungs_of(FIRST, COMPUTES, 0.01, rng), rungs_of(SECOND, COMPUTES, 0.01, rng)
        found = readings(first, second, 0.9)
        at = {g["compute"]: g["high"] - g["low"] for g in found if g["at_rung"]}
        rungs = sorted(at)
        between = [g for g in found if not g["at_rung"]]
        assert len(between) == (len(rungs) - 1) * (STEPS - 1)
        for g in between:
            lo = max(c for c in rungs if c < g["compute"])
            hi = min(c for c in rungs if c > g["compute"])
            assert g["high"] - g["low"] >= max(at[lo], at[hi]) and g["line_error"] > 0


STEPS = 8  # lm.compare.ladder_verdicts.STEPS_BETWEEN


def test_no_value_is_read_past_an_architectures_last_run():
    """One measured to 1e12, the other to 1e13: nothing is read above 1e12 but where a rung of each lies within 2%
    of the other's (compared there as matched, each at its own rung); below that, the second is read between its
    rungs at the first's last compute exactly, not held flat past it."""
    from lm.compare.ladder_verdicts import read, readings

    rng = np.random.default_rng(6)
    first = rungs_of(FIRST, np.logspace(9, 12, 4), 0.003, rng)
    second = rungs_of(SECOND, np.logspace(9, 13, 5), 0.003, rng)
    assert read(first, 1.001e12) is None and read(first, 0.999e9) is None and read(first, 0.999e12) is not None
    found = readings(first, second, 0.9)
    assert max(g["compute"] for g in found) == pytest.approx(1e12, rel=1e-12)
    found = compare(("one", "two"), first, second, 0.9)
    assert found["range"][1] == pytest.approx(1e12, rel=1e-12) and found["verdict"].endswith("to 1.000e12")
    nudged = second[:3] + [RungMean("r3", 1.015e12, second[3].mean, second[3].var, 3), second[4]]
    top = readings(first, nudged, 0.9)[-1]
    assert top["matched"] and top["compute"] == pytest.approx(math.sqrt(1e12 * 1.015e12))
    assert top["rungs"] == (("r3",), ("r3",)) and top["line_error"] == 0
    alone = compare(("one", "two"), first[:1], [RungMean("x", 1.1e9, 3.0, 1e-4, 3)], 0.9)  # 10% apart: no reading
    assert alone["range"] is None and alone["verdict"].startswith("no compute where both can be read")


# A second synthetic ladder, with no noise: attention a pure power law (E = 0); hawk another, its largest rung 3% above
# it. Four rungs, an lr grid whose middle is each one's best lr, two fresh seeds, a target 10x past.
PURE = lambda c: 40 * c ** -0.1  # noqa: E731
MISSED = lambda c: 25 * c ** -0.08  # noqa: E731
MISS = 0.03
PURE_LAWS = {"attention": Law(PURE), "hawk": Law(MISSED, offsets={"330k": MISS})}


def pure_ladder(tmp: Path, data: str, **extra) -> Path:
    write_base(tmp, data, lr=1e-2)
    (tmp / "ladder.yaml").write_text(yaml.safe_dump({
        "archs": ["attention", "hawk"], "rungs": [1.0e5, 1.5e5, 2.2e5, 3.3e5], "base": "base.yaml",
        "tokens_per_param": 2, "seeds": [1, 2], "bootstrap": 40, "lr": {"grid": [5e-3, 1e-2, 2e-2]}, **extra}))
    return tmp / "ladder.yaml"


@pytest.fixture(scope="module")
def pure(kjv_data, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("pure")
    patch = pytest.MonkeyPatch()
    patch.setattr(ladder_module, "train_run", synthetic(PURE_LAWS))
    try:
        ladder_module.ladder(str(pure_ladder(tmp, kjv_data, target_compute=1e13)), out=str(tmp / "out"), workers=1)
    finally:
        patch.undo()
    return tmp


def test_a_pure_power_law_fits_with_e_at_zero_and_the_built_held_out_error(pure):
    """Attention's law is fitted with E = 0, at its bound, and predicts its largest rung from the others exactly;
    hawk's, fitted without its largest rung, misses it by the 3% built in, to 1e-6 nats."""
    fits = json.loads((pure / "out" / "report" / "fits.json").read_text())
    fit = fits["fits"]["attention"]
    assert fit["E"] == pytest.approx(0.0, abs=1e-9) and fit["converged"]
    assert fit["held_out"]["largest"] == pytest.approx(0.0, abs=1e-6)
    top = [p["compute"] for p in fits["points"]["hawk"] if p["rung"] == "330k"]
    assert fits["fits"]["hawk"]["held_out"]["largest"] == pytest.approx(-MISS * MISSED(np.mean(top)), abs=1e-6)
    row = table_row((pure / "out" / "report" / "ladder.md").read_text(), "attention")
    assert row[4].startswith("not identified (0, at its bound") and row[5] == "yes"


def test_a_fit_that_does_not_converge_says_so_in_the_report(pure, monkeypatch):
    """The same runs, the report written again with the optimiser capped at 2 evaluations."""
    from lm.compare import scaling_fit

    monkeypatch.setattr(scaling_fit, "MAX_EVALUATIONS", 2)
    monkeypatch.setattr(ladder_module, "train_run", synthetic(PURE_LAWS))
    ladder_module.ladder(str(pure / "ladder.yaml"), out=str(pure / "out"), workers=1)
    report = (pure / "out" / "report" / "ladder.md").read_text()
    assert table_row(report, "hawk")[5] == "no: the fit stopped at its evaluation cap"  # (its law misses a rung)
    assert "cannot tell: a fit did not converge" in table_row(report.split("## Beyond")[1], "attention / hawk")[3]
    fits = json.loads((pure / "out" / "report" / "fits.json").read_text())
    assert not fits["fits"]["hawk"]["converged"]


def test_two_seeds_read_the_data_in_two_orders_unless_the_ladder_fixes_it(pure, kjv_data, tmp_path):
    """The ladder's configs of seeds 1 and 2 at one rung and lr: each run's data order is its seed's, so their first
    batches differ; written with data_seed, both read one order."""
    from lm.compare.ladder_config import load_ladder
    from lm.compare.ladder_plan import Run, plan_rungs
    from lm.compare.plan import load_base
    from lm.training.config import parse_run_config
    from lm.training.data_module import TokenDataModule

    def first_batch(config: Path):
        run, _, _ = parse_run_config(["--config", str(config)])
        return run.data.seed, next(iter(TokenDataModule(run.data).train_dataloader()))

    configs = sorted((pure / "out" / "configs").glob("attention-100k-lr0.01-seed[12].yaml"))
    (one, a), (two, b) = (first_batch(c) for c in configs)
    assert (one, two) == (1, 2) and not torch.equal(a, b)
    spec = load_ladder(str(pure / "ladder.yaml"))
    raw, base = load_base(spec.base)
    rung = plan_rungs(spec, base, 4)["attention"][0]
    fixed = [ladder_module.write_config(tmp_path, Run(rung, 1e-2, seed), raw, base, 4, kjv_data, 5) for seed in (1, 2)]
    (one, a), (two, b) = (first_batch(c) for c in fixed)
    assert one == two == 5 and torch.equal(a, b)


def test_a_ladder_whose_runs_ran_two_codes_is_refused_in_one_line(kjv_data, tmp_path, monkeypatch):
    """One run's record names another commit: the report is refused in one line, before anything is written, unless
    the ladder file allows mixed code."""
    from lm.util.errors import UserError

    monkeypatch.setattr(ladder_module, "train_run", synthetic(PURE_LAWS))
    ladder = pure_ladder(tmp_path, kjv_data, bootstrap=10)
    ladder_module.ladder(str(ladder), out=str(tmp_path / "out"), workers=1)
    record = next((tmp_path / "out" / "runs").glob("hawk-330k-*-seed2")) / "run_record.json"
    written = json.loads(record.read_text())
    written["launches"][0]["code"] = {**written["launches"][0]["code"], "commit": "0" * 40, "dirty": False}
    record.write_text(json.dumps(written))
    (tmp_path / "out" / "report" / "ladder.md").unlink()
    with pytest.raises(UserError) as refused:
        ladder_module.ladder(str(ladder), out=str(tmp_path / "out"), workers=1)
    assert "\n" not in str(refused.value) and "would mix lm code (" in str(refused.value)
    assert "000000000000: 1 run(s)" in str(refused.value) and "allow_mixed_code" in str(refused.value)
    assert not (tmp_path / "out" / "report" / "ladder.md").exists()
    ladder.write_text(ladder.read_text() + "allow_mixed_code: true\n")
    ladder_module.ladder(str(ladder), out=str(tmp_path / "out"), workers=1)
    report = (tmp_path / "out" / "report" / "ladder.md").read_text()
    assert "- code: 2 different (" in report


def test_a_small_ladders_report_says_no_more_than_its_runs(kjv_data, tmp_path, monkeypatch):
    """Two architectures at 3 sizes and one budget, one seed each, no target_compute (the small ladder a newcomer
    tries): no interval of one value ("one seed"), no reading at a compute nobody asked for and no bands, the
    comparison counting 6 runs of 2 architectures and naming each row by its architecture and size, and a fits.json a
    strict reader (one that refuses NaN) takes."""
    laws = {"attention": Law(lambda c: 1.5 + 4e3 * c ** -0.35), "hawk": Law(lambda c: 1.4 + 3e3 * c ** -0.34)}
    monkeypatch.setattr(ladder_module, "train_run", synthetic(laws))
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "seed": 0, "model": {"vocab_size": 512, "max_seq_len": 32},
        "data": {"path": kjv_data, "seq_len": 32, "micro_batch": 4, "global_batch": 4, "num_workers": 0},
        "trainer": {"val_every": 10**6, "progress_bar": False}, "strategy": {"accelerator": "cpu", "devices": 1}}))
    (tmp_path / "ladder.yaml").write_text(yaml.safe_dump({
        "archs": ["attention", "hawk"], "rungs": [1.0e5, 1.5e5, 2.2e5], "budgets": [3e10], "base": "base.yaml",
        "seeds": [1], "bootstrap": 20, "lr": {"grid": [1e-2]}}))
    ladder_module.ladder(str(tmp_path / "ladder.yaml"), out=str(tmp_path / "out"), workers=1)
    report = tmp_path / "out" / "report"
    text = (report / "ladder.md").read_text()
    optimum = table_row(text.split("## Compute-optimal")[1], "attention")
    assert optimum[3] == "one seed: no interval" and optimum[4].rstrip(" |").endswith("(one seed)")
    assert " to " not in optimum[3] and "[" not in optimum[4]
    assert "FLOPs [90%]" not in text and "## Beyond" not in text  # no "loss at C FLOPs" column
    assert table_row(text, "attention / hawk")[2].startswith("one seed: no interval")
    compare_md = (report / "compare" / "report.md").read_text()
    assert "6 runs of 2 architecture(s) in 6 groups" in compare_md
    best = compare_md.split("## Best run")[1].split("## ")[0]
    rows = [line for line in best.splitlines() if line.startswith(("| attention", "| hawk"))]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert len(names) == 6, names
    assert all(re.fullmatch(r"(attention|hawk) \([\d.]+k params, [\d.]+k tokens\)", name) for name in names), names

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    fits = json.loads((report / "fits.json").read_text(), parse_constant=refuse)
    assert fits["target_compute"] is None

"""The ladder's statistics against closed forms on hand-made cases, no training: a gap's interval against scipy's Welch
interval (unequal variances and counts) and against t at the Welch-Satterthwaite degrees of freedom for a pooled rung;
an interval between rungs against its formula; the F test of E = 0 against scipy's F quantile; E's and alpha's
identification, each branch; every label the report can print; and the refusal of a run that would read its corpus
just more than once."""

import math

import numpy as np
import pytest
from scipy import stats

from lm.compare.ladder_plan import Corpus, Rung, check_data
from lm.compare.ladder_report import (
    choice_lines,
    converged_text,
    estimate_text,
    fit_rows,
    identified,
    optimum_rows,
    power_law_allowed,
)
from lm.compare.ladder_verdicts import RungMean, compare, extrapolated, readings, verdict_text
from lm.util.errors import UserError

LEVEL = 0.9


def rung(label: str, compute: float, losses: list[float]) -> RungMean:
    x = np.array(losses)
    return RungMean(label, compute, float(x.mean()), float(x.var(ddof=1)) if len(x) > 1 else None, len(x))


def test_a_gap_at_matched_computes_is_welchs_interval():
    """Three seeds against five, unequal variances: the gap and its 90% interval and degrees of freedom are scipy's
    Welch's."""
    a, b = [2.01, 2.05, 1.98], [2.10, 2.16, 2.07, 2.12, 2.20]
    found = compare(("a", "b"), [rung("x", 1e12, a)], [rung("y", 1.01e12, b)], LEVEL)
    (gap,) = found["gaps"]
    welch = stats.ttest_ind(a, b, equal_var=False)
    assert gap["gap"] == pytest.approx(np.mean(a) - np.mean(b), rel=1e-12)
    assert gap["df"] == pytest.approx(welch.df, rel=1e-12)
    interval = welch.confidence_interval(LEVEL)
    assert (gap["low"], gap["high"]) == pytest.approx((interval.low, interval.high), rel=1e-12)
    assert found["verdict"] == "a lower than b at 1.005e12"


def test_a_rung_of_one_seed_takes_the_variance_pooled_over_its_others():
    """b's rung at 1e12 has one seed: its variance is b's other rungs' pooled (by their degrees of freedom); the
    interval is t at Welch-Satterthwaite's degrees of freedom of the two terms."""
    a = [rung("a0", 1e11, [3.0, 3.1, 2.9]), rung("a1", 1e12, [2.5, 2.6, 2.45, 2.55])]
    b = [rung("b0", 1e11, [3.2, 3.3]), rung("b1", 1e12, [2.7]), rung("b2", 1e13, [2.2, 2.3, 2.25])]
    at = next(g for g in readings(a, b, LEVEL) if g["compute"] == pytest.approx(1e12, rel=1e-12))
    pooled = (1 * np.var([3.2, 3.3], ddof=1) + 2 * np.var([2.2, 2.3, 2.25], ddof=1)) / 3
    terms = [(np.var([2.5, 2.6, 2.45, 2.55], ddof=1) / 4, 3), (pooled / 1, 3)]
    df = sum(v for v, _ in terms) ** 2 / sum(v * v / d for v, d in terms)
    half = stats.t.ppf((1 + LEVEL) / 2, df) * math.sqrt(sum(v for v, _ in terms))
    assert at["df"] == pytest.approx(df, rel=1e-12)
    assert (at["low"], at["high"]) == pytest.approx((at["gap"] - half, at["gap"] + half), rel=1e-12)


def test_a_reading_between_rungs_is_its_formula():
    """Halfway (in log C) between two rungs of three: the line's mean, the larger of the two rungs' variances of the
    mean, the fewest degrees of freedom of any term, and each line's error: half its curvature (twice the middle rung's
    miss from the line through its neighbours over the product of its distances to them) times the product of the
    distances to the two rungs."""
    computes = [1e10, 1e11, 1e12]
    a = [rung(f"a{i}", c, s) for i, (c, s) in enumerate(zip(computes, [[4.0, 4.2], [3.3, 3.32, 3.2], [3.0, 3.05]]))]
    b = [rung(f"b{i}", c, s) for i, (c, s) in enumerate(zip(computes, [[4.5, 4.4, 4.6], [3.6, 3.7], [3.1, 3.0, 3.2]]))]
    c = math.sqrt(1e10 * 1e11)
    found = next(g for g in readings(a, b, LEVEL) if g["compute"] == pytest.approx(c, rel=1e-12))
    x = [math.log(v) for v in computes]
    xc = math.log(c)

    def line(means):
        h1, h2 = x[1] - x[0], x[2] - x[1]
        miss = means[1].mean - (means[0].mean + (means[2].mean - means[0].mean) * h1 / (h1 + h2))
        return 0.5 * (2 * abs(miss) / (h1 * h2)) * (xc - x[0]) * (x[1] - xc)

    var = [max(m[0].var / m[0].n, m[1].var / m[1].n) for m in (a, b)]
    df = min(m[j].n - 1 for m in (a, b) for j in (0, 1))
    half = stats.t.ppf((1 + LEVEL) / 2, df) * math.sqrt(sum(var)) + line(a) + line(b)
    gap = (a[0].mean + a[1].mean) / 2 - (b[0].mean + b[1].mean) / 2
    assert found["gap"] == pytest.approx(gap, rel=1e-12) and found["df"] == df
    assert (found["low"], found["high"]) == pytest.approx((gap - half, gap + half), rel=1e-12)
    assert found["rungs"] == (("a0", "a1"), ("b0", "b1")) and not found["at_rung"]


def test_the_f_test_of_a_pure_power_law_is_scipys_f_quantile():
    """F = (the line's weighted squared residuals - the free fit's) / (the free fit's / (K - 3)) against
    F(1, K - 3)'s quantile at the level: just under it E = 0 is allowed, just over it not."""
    x = np.log(np.logspace(10, 13, 5))
    y = np.log(3.0 + 200 * np.exp(x) ** -0.2)
    weights = np.array([1.0, 2.0, 0.5, 1.5, 1.0])
    slope, intercept = np.polyfit(x, y, 1, w=weights)
    line = float(np.sum((weights * (y - intercept - slope * x)) ** 2))
    dof = len(x) - 3
    critical = stats.f.ppf(LEVEL, 1, dof)
    for factor, allowed in ((0.99, True), (1.01, False)):
        free = line / (1 + factor * critical / dof)  # the free fit's sum of squares that makes F = factor x critical
        residual = np.sqrt(free / np.sum(weights ** 2)) * np.ones_like(x)
        assert power_law_allowed(x, y, weights, residual, LEVEL) is allowed
    assert power_law_allowed(x[:3], y[:3], weights[:3], np.zeros(3), LEVEL)  # K = 3: no degree of freedom left
    on_line = intercept + slope * x
    assert power_law_allowed(x, on_line, np.ones(5), np.zeros(5), LEVEL)  # both exact
    assert not power_law_allowed(x, y, weights, np.zeros(5), LEVEL)  # the free law exact, the line not


def fit(**changes) -> dict:
    base = {"E": 1.5, "E_interval": (1.2, 1.8), "alpha": 0.3, "alpha_interval": (0.2, 0.5), "lowest_loss": 2.0,
            "power_law_allowed": False}
    return {**base, **changes}


@pytest.mark.parametrize("changes, e, alpha", [
    ({}, True, True),
    ({"power_law_allowed": True}, False, True),  # the F test allows E = 0
    ({"E": 0.015}, False, True),  # the point below 1% of the lowest loss
    ({"E_interval": (0.01, 1.8)}, False, True),  # the interval reaches the bound
    ({"alpha_interval": (-0.01, 0.5)}, True, False),  # not positive
    ({"alpha_interval": (0.02, 0.5)}, True, False),  # spans more than 10x
])
def test_e_and_alpha_are_identified_only_where_the_data_pin_them(changes, e, alpha):
    found = fit(**changes)
    identified(found, LEVEL)
    assert found["E_identified"] is e and found["alpha_identified"] is alpha


def test_every_label_of_the_fits_table():
    found = fit(E=0.0, E_interval=(0.0, 0.4), power_law_allowed=True)
    identified(found, LEVEL)
    assert estimate_text(found, "E") == "not identified (0, at its bound; the data allow E = 0)"
    found = fit(power_law_allowed=True)
    identified(found, LEVEL)
    assert estimate_text(found, "E") == "not identified (1.5; the data allow E = 0)"
    found = fit(alpha_interval=(0.01, 0.5))
    identified(found, LEVEL)
    assert estimate_text(found, "alpha") == "not identified (0.3; interval 0.01 to 0.5)"
    found = fit(E=1.9)
    identified(found, LEVEL)
    assert estimate_text(found, "E") == "1.9 [1.2, 1.8] (the point lies outside its interval)"
    assert estimate_text(found, "alpha") == "0.3 [0.2, 0.5]"
    assert converged_text({"converged": False}) == "no: the fit stopped at its evaluation cap"
    assert converged_text({"converged": True, "replicates_converged": 1.0}) == "yes"
    assert converged_text({"converged": True, "replicates_converged": 0.995}) == "yes (99.5% of the replicates)"
    full = {**found, "theta": [1.9, 5.0, 0.3], "runs": 12, "rungs": 4, "converged": True, "replicates_converged": 1.0,
            "held_out": {"largest": None, "rms": None}, "rms_log_residual": 0.01, "largest_compute": 1e12,
            "target_loss": 2.0, "target_interval": (1.9, 2.1)}
    rows = fit_rows({"a": full, "b": {"runs": 3, "why": "3 rung(s) with finished runs: ..."}}, 3.2e12)
    assert rows[0][6] == "too few rungs" and rows[0][9] == "2 [1.9, 2.1]; extrapolated, 3.2x past the largest run"
    assert rows[1] == ["b", "3", "3 rung(s) with finished runs: ...", "", "", "", "", "", "", ""]
    inside = fit_rows({"a": {**full, "held_out": {"largest": -0.012, "rms": 0.02}}}, 1e12)[0]
    assert inside[6:8] == ["-0.012", "0.020"] and inside[9].endswith("; inside the runs")
    assert len(fit_rows({"a": full}, None)[0]) == 9  # no target: no column for it


def test_every_label_of_a_verdict():
    gaps = lambda side, at_rung: [{"compute": 1e11, "low": -2.0 if side < 0 else 0.1 if side > 0 else -1.0,  # noqa
                                   "high": -1.0 if side < 0 else 2.0 if side > 0 else 1.0, "at_rung": at_rung,
                                   "rungs": (("a1", "a2"), ("b3", "b4"))}]
    segment = lambda side, at_rung, lo=1e10, hi=1e12: [side, lo, hi, gaps(side, at_rung)]  # noqa: E731
    names = ("one", "two")
    assert verdict_text(names, [segment(-1, True)], gaps(-1, True)) == "one lower than two from 1.000e10 to 1.000e12"
    assert verdict_text(names, [segment(1, True, 1e11, 1e11)], gaps(1, True)) == "two lower than one at 1.000e11"
    assert verdict_text(names, [segment(0, True)], gaps(0, True)) == "cannot tell from 1.000e10 to 1.000e12"
    assert verdict_text(names, [segment(-1, False)], gaps(-1, False)) == (
        "one lower than two from 1.000e10 to 1.000e12 (only between rungs: one's a1 and a2, two's b3 and b4)")
    nan = [{**gaps(0, True)[0], "low": math.nan, "high": math.nan}]
    assert verdict_text(names, [segment(0, True)], nan) == (
        "one seed: no interval (a rung of one seed, and no other rung's seeds to pool)")


def test_every_reading_beyond_the_measured_range():
    def law(e, error, converged=True):
        return {"theta": [e, math.log(100.0), 0.2], "held_out": {"largest": error}, "converged": converged}

    beyond = lambda fits: extrapolated(("one", "two"), fits, 1e14, (1e10, 1e12), (1e12, 1e12))  # noqa: E731
    assert beyond((law(1.0, None), law(1.5, 0.01)))["reading"].startswith("cannot tell: no held-out error")
    assert beyond((law(1.0, 0.01, False), law(1.5, 0.01)))["reading"] == "cannot tell: a fit did not converge"
    assert beyond((law(1.0, 0.3), law(1.5, 0.3)))["reading"].startswith("cannot tell: the curves' gap, 0.500 nats")
    found = beyond((law(1.0, 0.01), law(1.5, 0.02)))
    assert found["reading"] == "one's curve lower by 0.500 nats, more than the held-out errors (0.010 + 0.020 nats)"
    assert found["label"] == "extrapolated, 100x past the largest run (one 100x, two 100x)"
    assert beyond(({"why": "2 rung(s)"}, law(1.5, 0.01)))["reading"] == "no fitted curve to read: one: 2 rung(s)"
    assert extrapolated(("one", "two"), (law(1.0, 0.0), law(1.5, 0.0)), 1e11, (1e10, 1e12), (1e12, 1e12)) is None


def test_every_label_of_the_compute_optimal_tables():
    rng = np.random.default_rng(0)

    def optimum(loss, seeded=True, inside=True):  # replicates of the optimal loss: independent, sd 0.005
        return {"budget": 1e16, "params_opt": 1e6, "loss_opt": loss, "identified": inside, "seeded": seeded,
                "params_interval": (9e5, 1.1e6) if seeded else None, "loss_interval": (loss - 0.01, loss + 0.01)
                if seeded else None, "loss_samples": loss + rng.normal(0, 0.005, 400)}

    table, verdicts = optimum_rows({"a": [optimum(2.0)], "b": [optimum(2.1)], "c": [optimum(2.0001)],
                                    "d": [optimum(2.0, seeded=False)], "e": [optimum(2.0, inside=False)]}, LEVEL)
    rows = {row[0]: row for row in table}
    assert rows["a"][3] == "900.00k to 1.10M" and rows["a"][4] == "2.0000 [1.9900, 2.0100]"
    assert rows["d"][3] == "one seed: no interval" and rows["d"][4] == "2.0000 (one seed)"
    assert rows["e"][3] == "not identified (outside the sizes tried)" and rows["e"][4] == ""
    said = {row[0]: row[3] for row in verdicts}
    assert said["a / b"] == "a lower, each at its own best size"
    assert said["a / c"] == "cannot tell"
    assert said["a / d"] == "one seed: no interval"
    assert said["a / e"].startswith("cannot tell: e's optimum is not identified")


def test_every_label_of_the_choice():
    rows = [{"value": 2, "rung": "310k", "losses": [2.0, 2.1, 2.05], "mean": 2.05, "spread": 0.1,
             "interval": (0.01, 0.09), "within": False},
            {"value": 8, "rung": "310k", "losses": [2.0, 2.01, 2.0], "mean": 2.0033, "spread": 0.01,
             "interval": (-0.01, 0.015), "within": True},
            {"value": 30, "rung": "310k", "losses": [2.0, 2.0, 2.0], "mean": 2.0, "spread": 0.0, "interval": None,
             "within": True}]
    chosen = {"arch": "mesa", "option": "cg_steps", "reference": 30, "lr": 0.01, "tolerance": 0.02, "level": LEVEL,
              "chosen": 8, "rows": rows, "rung": 3.1e5, "largest_rung": 3.1e5, "confirmed": True}
    text = "\n".join(choice_lines(chosen))
    assert "is chosen: **cg_steps 8**. It was made at the 310k rung, the largest that uses it." in text
    assert "| cg_steps 2 | 310k | 2.0000, 2.1000, 2.0500 | 2.0500 | 0.1000 | +0.0500 [+0.0100, +0.0900] | no |" in text
    assert "| (the reference) | yes |" in text
    text = "\n".join(choice_lines({**chosen, "rung": 6.2e4, "confirmed": False}))
    assert "not confirmed at the largest rung that uses it (310k): it rests on the smaller rung's runs." in text


def test_a_run_that_reads_its_corpus_just_more_than_once_is_refused():
    """At exactly one epoch a run is planned; one token more, and the plan is refused in one line."""
    from types import SimpleNamespace

    spec = SimpleNamespace(path="ladder.yaml", repeat_data=False)

    def rungs(tokens: int) -> dict:
        return {"a": [Rung("a", 1e5, None, {}, 100_000, 1e6, 10, 10, tokens)]}

    check_data(spec, rungs(1_000_000), Corpus(1_000_000, "corpus"))
    with pytest.raises(UserError) as refused:
        check_data(spec, rungs(1_000_001), Corpus(1_000_000, "corpus"))
    assert "1.00 epochs of the corpus's" in str(refused.value) and "\n" not in str(refused.value)
    check_data(SimpleNamespace(path="ladder.yaml", repeat_data=True), rungs(2_000_000), Corpus(1_000_000, "corpus"))


def test_an_earlier_report_is_reread_by_todays_instrument(tmp_path, capsys):
    """`lm research ladder-reread` on a fits.json of runs of a pure power law whose largest rung lies 3% above it, two
    seeds a rung: both fits without that rung predict it 3% low; the verdict of two such architectures 10% apart."""
    import json

    from lm.research.ladder_reread import ladder_reread

    computes = np.logspace(10, 12, 4)
    rows = lambda scale: [{"rung": f"r{i}", "compute": c, "seed": s, "loss": scale * 40 * c ** -0.1 * (  # noqa: E731
        1.03 if i == 3 else 1.0) * (1 + 0.001 * s)} for i, c in enumerate(computes) for s in (1, 2)]
    (tmp_path / "fits.json").write_text(json.dumps({"fitted": {"a": rows(1.0), "b": rows(1.1)}, "fits": {}}))
    found = ladder_reread(str(tmp_path / "fits.json"))
    assert found["verdicts"]["a / b"] == "a lower than b from 1.000e10 to 1.000e12"
    miss = -0.03 * 40 * 1e12 ** -0.1 * 1.0015
    for error in ("huber_on_runs", "rung_means"):
        assert found["held_out"]["a"][error] == pytest.approx(miss, abs=2e-3)
    assert found["held_out"]["a"]["reported"] is None and "a / b: a lower than b" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="no ladder report's fits.json"):
        ladder_reread(str(tmp_path / "bad.json"))
    with pytest.raises(UserError, match="not found"):
        ladder_reread(str(tmp_path / "none.json"))

"""Scaling-law fits (lm/compare/scaling_fit.py): a known law is recovered within its bootstrap intervals, and those
intervals hold the truth at about their nominal rate over repeated draws; the "misfit" intervals also hold a truth the
law cannot follow, where resampling seeds alone does not; the held-out error is the miss at a rung left out;
noiseless data are fitted exactly (L(C) and L(N, D)); one outlier barely moves the Huber fit where it moves least
squares; crossovers are found where they are built; bad input is one UserError."""

import math

import numpy as np
import pytest

from lm.compare import scaling_fit
from lm.compare.scaling_fit import (
    Law,
    bootstrap_laws,
    crossover,
    crossovers,
    fit_law,
    fit_thetas,
    held_out,
    interval,
    predict_thetas,
)
from lm.util.errors import UserError

E, A, ALPHA = 1.8, 1000.0, 0.2  # L from about 5.8 at 1e12 FLOPs to 2.4 at 1e16, like small language models
SIGMA = 0.01  # run-to-run noise of a final loss, multiplicative
C = np.repeat(np.logspace(12, 16, 6), 3)  # 6 rungs, 3 seeds each
RUNG = np.repeat(np.arange(6), 3)


def law_c(c: np.ndarray, e: float = E, a: float = A, alpha: float = ALPHA) -> np.ndarray:
    return e + a * c**-alpha


def noisy(rng: np.random.Generator) -> np.ndarray:
    return law_c(C) * np.exp(rng.normal(0.0, SIGMA, C.size))


@pytest.mark.parametrize("method, groups", [("cases", RUNG), ("cases", None), ("residuals", None), ("misfit", RUNG)])
def test_recovers_a_known_law_within_its_intervals(method, groups):
    losses = noisy(np.random.default_rng(0))
    law = fit_law(C, losses)
    thetas = bootstrap_laws(C, losses, groups=groups, reps=1000, seed=0, method=method)
    assert thetas.shape == (1000, 3)
    lo, hi = interval(thetas[:, 2])
    assert lo <= ALPHA <= hi and lo <= law.exponents[0] <= hi
    lo, hi = interval(np.exp(thetas[:, 0]))
    assert lo <= E <= hi and lo <= law.E <= hi
    assert law.exponents[0] == pytest.approx(ALPHA, rel=0.05)
    assert law.E == pytest.approx(E, rel=0.05)
    assert law.coefficients[0] == pytest.approx(A, rel=0.3)
    assert law.predict(C) == pytest.approx(law_c(C), rel=3 * SIGMA)


def test_bootstrap_is_deterministic_and_redraws_replicates_it_cannot_fit():
    """Three rungs of two runs: a plain resample misses a rung a quarter of the time, and a curve through two values
    of C is not determined; redrawn, every replicate of noiseless data is the true law."""
    c = np.repeat([1e12, 1e14, 1e16], 2)
    rung = np.repeat([0, 1, 2], 2)
    truth = [math.log(E), math.log(A), ALPHA]
    for groups in (None, rung):
        thetas = bootstrap_laws(c, law_c(c), groups=groups, reps=300, seed=5)
        assert thetas == pytest.approx(np.broadcast_to(truth, thetas.shape), rel=1e-6, abs=1e-6)
    losses = noisy(np.random.default_rng(2))
    first, again = (bootstrap_laws(C, losses, groups=RUNG, reps=50, seed=3) for _ in range(2))
    assert np.array_equal(first, again)
    assert not np.array_equal(first, bootstrap_laws(C, losses, groups=RUNG, reps=50, seed=4))


@pytest.mark.parametrize("method, groups", [("cases", RUNG), ("cases", None), ("residuals", None), ("misfit", RUNG)])
def test_intervals_cover_the_truth_at_about_the_nominal_rate(method, groups):
    """90% intervals over 100 draws: the binomial sd of the share is 3%, so a correct bootstrap (about 0.87, 0.95, 0.84
    and 0.95 for these four, measured by `python -m lm.compare.scaling_fit`) lands in the band with high probability,
    and one that understates the noise (or resamples without replacement) does not. 100 replicates keep it fast."""
    rng = np.random.default_rng(7)
    held = np.zeros(2)
    draws = 100
    for draw in range(draws):
        thetas = bootstrap_laws(C, noisy(rng), groups=groups, reps=100, seed=draw, method=method)
        for i, (samples, truth) in enumerate([(thetas[:, 2], ALPHA), (np.exp(thetas[:, 0]), E)]):
            lo, hi = interval(samples, 0.9)
            held[i] += lo <= truth <= hi
    share = held / draws
    assert np.all((0.78 <= share) & (share <= 0.98)), share


def test_misfit_intervals_hold_a_law_the_fit_cannot_follow():
    """A truth bent past 1e14 FLOPs (scaling_fit.BROKEN) that E + A C^-alpha misses near the bend by 2-3x the seeds'
    noise: 90% intervals of the loss at 3e14, inside the rungs, over 60 draws. Resampling seeds within rungs measures
    the seeds' noise only and holds the truth in about a quarter of the draws; adding each rung's residual (misfit)
    holds it in about 0.88 (coverage measured on 400 draws: docs/ladder.md); the binomial sd is 0.04 to 0.06."""
    rng = np.random.default_rng(3)
    held = {"cases": 0, "misfit": 0}
    for draw in range(60):
        losses = scaling_fit.BROKEN(C) * np.exp(rng.normal(0.0, SIGMA, C.size))
        for method in held:
            thetas = bootstrap_laws(C, losses, groups=RUNG, reps=100, seed=draw, method=method)
            lo, hi = interval(predict_thetas(thetas, [3e14])[:, 0])
            held[method] += lo <= scaling_fit.BROKEN(3e14) <= hi
    assert held["cases"] <= 30 and held["misfit"] >= 45, held


def test_the_held_out_error_is_the_miss_at_a_rung_left_out():
    """The law exact at five rungs but the largest, whose runs lie 0.05 nats above it: fitted without that rung, the
    law passes exactly through the others, so its error there is -0.05 (predicted minus measured); leaving out any
    other rung keeps the shifted one in, and the fit misses."""
    c = np.repeat(np.logspace(12, 16, 5), 2)
    rung = np.repeat(np.arange(5), 2)
    losses = law_c(c) + np.where(rung == 4, 0.05, 0.0)
    found = held_out(c, losses, rung)
    assert found["largest_rung"] == 4 and found["largest"] == pytest.approx(-0.05, abs=1e-6)
    assert list(found["errors"]) == [0, 1, 2, 3, 4] and all(abs(e) > 1e-4 for e in found["errors"].values())
    assert found["max"] == pytest.approx(max(abs(e) for e in found["errors"].values()))
    three = held_out(c[:6], losses[:6], rung[:6])  # three rungs: two left to fit a law of three parameters
    assert three["largest"] is None and three["rms"] is None


def test_fits_converge_within_the_iteration_cap(monkeypatch):
    """Replicates that repeat runs leave the Huber objective flat along a valley, where a fit can crawl: a tenfold
    cap changes none of them."""
    losses = noisy(np.random.default_rng(0))
    capped = bootstrap_laws(C, losses, groups=RUNG, reps=300, seed=1)
    monkeypatch.setattr(scaling_fit, "ITERATIONS", 10 * scaling_fit.ITERATIONS)
    assert bootstrap_laws(C, losses, groups=RUNG, reps=300, seed=1) == pytest.approx(capped, rel=1e-7, abs=1e-9)


def test_stratified_replicates_hold_every_group_as_often_as_the_data():
    rows = scaling_fit._case_rows(C[:, None], RUNG, 200, np.random.default_rng(0))
    assert np.all(np.sort(RUNG[rows], axis=1) == RUNG)
    assert len(np.unique(rows)) == C.size  # and within a group, any of its runs
    lone = np.append(RUNG[:-1], 9)  # one group of one run: plain resampling over all runs
    plain = scaling_fit._case_rows(C[:, None], lone, 200, np.random.default_rng(0))
    assert np.any(np.sort(RUNG[plain], axis=1) != RUNG)


def test_noiseless_data_are_fitted_exactly():
    law = fit_law(C, law_c(C))
    assert law.variables == ("C",)
    assert law.exponents[0] == pytest.approx(ALPHA, rel=1e-6)
    assert law.E == pytest.approx(E, rel=1e-6)
    assert law.coefficients[0] == pytest.approx(A, rel=1e-5)

    n, d = (v.ravel() for v in np.meshgrid([1e7, 3e7, 1e8, 3e8, 1e9], [2e9, 1e10, 5e10, 2e11]))
    losses = 1.69 + 406.4 * n**-0.34 + 410.7 * d**-0.28  # the Chinchilla fit
    law = fit_law(np.stack([n, d], axis=1), losses, variables=("N", "D"))
    assert law.predict(np.stack([n, d], axis=1)) == pytest.approx(losses, rel=1e-10)
    assert law.exponents == pytest.approx((0.34, 0.28), rel=1e-6)
    assert law.E == pytest.approx(1.69, rel=1e-6)
    assert law.coefficients == pytest.approx((406.4, 410.7), rel=1e-5)


def test_fits_of_a_batch_are_independent():
    rng = np.random.default_rng(3)
    y = np.log(np.stack([noisy(rng) for _ in range(4)]))
    x = np.broadcast_to(np.log(C)[None, :, None], (4, C.size, 1))
    together = fit_thetas(x, y)
    alone = np.concatenate([fit_thetas(x[i : i + 1], y[i : i + 1]) for i in range(4)])
    assert together == pytest.approx(alone, rel=1e-8, abs=1e-10)
    assert predict_thetas(together, C) == pytest.approx(np.stack([Law(("C",), t).predict(C) for t in together]))


def test_one_outlier_barely_moves_the_huber_fit_but_moves_least_squares():
    """alpha's bootstrap sd here is about 0.005: a run 1.5x too high moves the Huber fit by two sd at most, least
    squares (a huge delta) by ten or more."""
    alpha = lambda losses, delta: fit_law(C, losses, delta=delta).exponents[0]
    for seed in range(3):
        losses = noisy(np.random.default_rng(seed))
        for run in (0, 9, 17):  # a seed of the first rung, of the fourth, of the last
            spoiled = losses.copy()
            spoiled[run] *= 1.5
            huber, least_squares = (abs(alpha(spoiled, delta) - alpha(losses, delta)) for delta in (1e-3, 1e9))
            assert huber < 0.01 and least_squares > max(0.05, 5 * huber), (seed, run, huber, least_squares)


def test_crossover_is_found_where_the_laws_cross():
    log_lo, log_hi = math.log(1e12), math.log(1e16)
    cross = 3e14
    first = np.log([1.8, 1000.0]).tolist() + [0.2]
    steeper = 0.3  # a lower floor, reached more steeply: worse at small C, better at large
    second = [math.log(1.5), math.log((law_c(cross) - 1.5) * cross**steeper), steeper]
    assert crossover(np.array(first), np.array(second), log_lo, log_hi) == pytest.approx(math.log(cross), abs=1e-9)
    assert predict_thetas(np.array([first, second]), [cross])[:, 0] == pytest.approx([law_c(cross)] * 2, rel=1e-12)
    # Through 1e13 and 1e15 with a steeper exponent: above, then below, then above (the higher floor) again.
    c1, c2, alpha = 1e13, 1e15, 0.35
    a_twice = (law_c(c1) - law_c(c2)) / (c1**-alpha - c2**-alpha)
    twice = np.array([math.log(law_c(c1) - a_twice * c1**-alpha), math.log(a_twice), alpha])
    assert crossover(np.array(first), twice, log_lo, log_hi) == pytest.approx(math.log(c1), abs=1e-9)
    assert crossover(np.array(first), twice, math.log(1e14), log_hi) == pytest.approx(math.log(c2), abs=1e-9)
    apart = np.array(first) + [math.log(1.1), 0.0, 0.0]  # E 10% higher: above everywhere
    assert crossover(np.array(first), apart, log_lo, log_hi) is None
    assert crossover(np.array(first), np.array(second), math.log(1e15), log_hi) is None

    rng = np.random.default_rng(4)
    ones = np.array(first) + rng.normal(0, [0.1, 0.5, 0.03], (200, 3))
    twos = np.array(second) + rng.normal(0, [0.1, 0.5, 0.03], (200, 3))
    found = crossovers(ones, twos, log_lo, log_hi)
    scalar = [crossover(one, two, log_lo, log_hi) for one, two in zip(ones, twos)]
    assert 20 < np.isnan(found).sum() < 180  # both kinds are checked
    assert [None if np.isnan(f) else pytest.approx(f, abs=1e-12) for f in found] == scalar
    lo, hi = interval(found)
    assert log_lo <= lo < hi <= log_hi


@pytest.mark.parametrize(
    "values, losses, variables",
    [
        (C[:4], law_c(C[:4]), ("C",)),  # two rungs: two distinct C
        (np.array([[1e7, 1e9], [3e7, 3e9], [1e8, 1e10], [1e7, 3e9]]), np.full(4, 3.0), ("N", "D")),  # 4 points of 5
        (C, np.where(RUNG == 2, 0.0, law_c(C)), ("C",)),
        (C, np.where(RUNG == 2, np.nan, law_c(C)), ("C",)),
        (-C, law_c(C), ("C",)),
        (C, law_c(C)[:-1], ("C",)),
        (np.stack([C, np.full(C.size, 1e9)], axis=1), law_c(C), ("N", "D")),  # one D: no curve in D
        (np.stack([C, np.where(RUNG % 2, 1e9, 1e10)], axis=1), law_c(C), ("N", "D")),  # two D: still none
    ],
)
def test_bad_input_is_one_user_error(values, losses, variables):
    with pytest.raises(UserError) as caught:
        fit_law(values, losses, variables)
    assert "\n" not in str(caught.value)
    with pytest.raises(UserError):
        bootstrap_laws(values, losses, reps=10, variables=variables)


def test_unknown_bootstrap_method_is_a_user_error():
    with pytest.raises(UserError, match="method"):
        bootstrap_laws(C, law_c(C), reps=10, method="jackknife")

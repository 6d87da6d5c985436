"""Scaling-law fits (lm/compare/scaling_fit.py): a law is fitted to rung means weighted by their seeds' pooled
variance (the weights against their closed form); a known law is recovered within its bootstrap intervals, and those
intervals hold the truth at about their nominal rate; a pure power law fits with E = 0 at its bound and a held-out
error that is the miss built into its largest rung, to 1e-6; noiseless data are fitted exactly (L(C) and L(N, D)); a
fit stopped by its evaluation cap says it did not converge; bad input is one UserError."""

import math

import numpy as np
import pytest

from lm.compare import scaling_fit
from lm.compare.scaling_fit import bootstrap_laws, fit_law, held_out, interval, predict_thetas, rungs_of
from lm.util.errors import UserError

E, A, ALPHA = 1.8, 1000.0, 0.2  # L from about 5.8 at 1e12 FLOPs to 2.4 at 1e16, like small language models
SIGMA = 0.01  # run-to-run noise of a final loss, multiplicative
C = np.repeat(np.logspace(12, 16, 6), 3)  # 6 rungs, 3 seeds each
RUNG = np.repeat(np.arange(6), 3)


def law_c(c: np.ndarray, e: float = E, a: float = A, alpha: float = ALPHA) -> np.ndarray:
    return e + a * c**-alpha


def noisy(rng: np.random.Generator) -> np.ndarray:
    return law_c(C) * np.exp(rng.normal(0.0, SIGMA, C.size))


def test_rungs_are_weighted_by_the_standard_error_of_their_log_mean():
    """Each rung's weight is 1 / (sd / mean / sqrt(n)), with one relative variance pooled over every rung's seeds (by
    their degrees of freedom): a rung's own 2-3 seeds estimate it too poorly to weight by."""
    c = np.array([1e12, 1e12, 1e12, 1e13, 1e13, 1e14, 1e15, 1e15])
    losses = np.array([4.0, 4.2, 4.1, 3.0, 3.3, 2.5, 2.0, 2.06])
    found = rungs_of(c, losses)
    groups = [losses[:3], losses[3:5], losses[5:6], losses[6:]]
    relative = [np.var(g, ddof=1) / g.mean() ** 2 for g in groups if len(g) > 1]
    dofs = [len(g) - 1 for g in groups if len(g) > 1]
    pooled = sum(d * v for d, v in zip(dofs, relative)) / sum(dofs)
    expected = [math.sqrt(pooled / 3), math.sqrt(pooled / 2), math.sqrt(pooled / 1), math.sqrt(pooled / 2)]
    assert found.errors == pytest.approx(expected, rel=1e-12)
    assert found.log_means == pytest.approx(np.log([g.mean() for g in groups]), rel=1e-12)
    assert found.values[:, 0] == pytest.approx([1e12, 1e13, 1e14, 1e15])
    assert rungs_of(c, np.where(c > 0, 3.0, 0)).errors is None  # no seed varies: equal weights


def test_recovers_a_known_law_within_its_intervals():
    losses = noisy(np.random.default_rng(0))
    law = fit_law(C, losses, groups=RUNG)
    thetas, converged = bootstrap_laws(C, losses, groups=RUNG, reps=300, seed=0)
    assert thetas.shape == (300, 3) and converged == 1.0 and law.converged
    lo, hi = interval(thetas[:, 2])
    assert lo <= ALPHA <= hi and lo <= law.exponents[0] <= hi
    lo, hi = interval(thetas[:, 0])
    assert lo <= E <= hi and lo <= law.E <= hi
    assert law.exponents[0] == pytest.approx(ALPHA, rel=0.05)
    assert law.E == pytest.approx(E, rel=0.05)
    assert law.predict(C) == pytest.approx(law_c(C), rel=3 * SIGMA)


def test_bootstrap_is_deterministic_from_its_seed():
    losses = noisy(np.random.default_rng(2))
    first, again = (bootstrap_laws(C, losses, groups=RUNG, reps=30, seed=3)[0] for _ in range(2))
    assert np.array_equal(first, again)
    assert not np.array_equal(first, bootstrap_laws(C, losses, groups=RUNG, reps=30, seed=4)[0])


def test_intervals_cover_the_truth_at_about_the_nominal_rate():
    """90% intervals of alpha and E over 30 draws of 40 replicates (binomial sd of the share about 5%): the misfit
    bootstrap errs wide where the law holds (`python -m lm.compare.scaling_fit`, docs/ladder.md)."""
    rng = np.random.default_rng(7)
    held, draws = np.zeros(2), 30
    for draw in range(draws):
        thetas, _ = bootstrap_laws(C, noisy(rng), groups=RUNG, reps=40, seed=draw)
        for i, (samples, truth) in enumerate([(thetas[:, 2], ALPHA), (thetas[:, 0], E)]):
            lo, hi = interval(samples, 0.9)
            held[i] += lo <= truth <= hi
    share = held / draws
    assert np.all((0.75 <= share) & (share <= 1.0)), share


def test_a_pure_power_law_fits_with_e_at_its_bound_and_its_held_out_error_is_the_built_miss():
    """L = 50 C^-0.1 at four rungs, the largest 3% above it: fitted without that rung the law passes exactly through
    the others with E = 0 (the bound, not a log running to minus infinity), and predicts the largest rung 3% low, to
    1e-6 nats."""
    c = np.repeat(np.logspace(10, 12.5, 4), 2)
    rung = np.repeat(np.arange(4), 2)
    pure = 50 * c**-0.1
    losses = pure * np.where(rung == 3, 1.03, 1.0)
    below = fit_law(c[rung < 3], losses[rung < 3], groups=rung[rung < 3])
    assert below.E == pytest.approx(0.0, abs=1e-6) and below.converged
    assert below.exponents[0] == pytest.approx(0.1, rel=1e-6)
    found = held_out(c, losses, rung)
    assert found["largest_rung"] == 3
    assert found["largest"] == pytest.approx(-0.03 * pure[rung == 3].mean(), abs=1e-6)


def test_the_held_out_error_is_one_number_per_rung_left_out():
    """The law exact at five rungs but the largest, whose runs lie 0.05 nats above it: fitted without that rung, the
    law passes through the others, so its error there is -0.05; leaving out any other rung keeps the shifted one in,
    and the fit misses. With three rungs, none can be left out."""
    c = np.repeat(np.logspace(12, 16, 5), 2)
    rung = np.repeat(np.arange(5), 2)
    losses = law_c(c) + np.where(rung == 4, 0.05, 0.0)
    found = held_out(c, losses, rung)
    assert found["largest_rung"] == 4 and found["largest"] == pytest.approx(-0.05, abs=1e-6)
    assert list(found["errors"]) == [0, 1, 2, 3, 4] and all(abs(e) > 1e-4 for e in found["errors"].values())
    assert found["max"] == pytest.approx(max(abs(e) for e in found["errors"].values()))
    three = held_out(c[:6], losses[:6], rung[:6])
    assert three["largest"] is None and three["rms"] is None


def test_a_fit_stopped_by_its_evaluation_cap_has_not_converged(monkeypatch):
    losses = noisy(np.random.default_rng(0))
    assert fit_law(C, losses, groups=RUNG).converged
    monkeypatch.setattr(scaling_fit, "MAX_EVALUATIONS", 2)
    assert not fit_law(C, losses, groups=RUNG).converged
    _, converged = bootstrap_laws(C, losses, groups=RUNG, reps=5, seed=0)
    assert converged < 1


def test_noiseless_data_are_fitted_exactly():
    law = fit_law(C, law_c(C))
    assert law.variables == ("C",)
    assert law.exponents[0] == pytest.approx(ALPHA, rel=1e-6)
    assert law.E == pytest.approx(E, rel=1e-6)
    assert law.coefficients[0] == pytest.approx(A, rel=1e-5)

    n, d = (v.ravel() for v in np.meshgrid([1e7, 3e7, 1e8, 3e8, 1e9], [2e9, 1e10, 5e10, 2e11]))
    losses = 1.69 + 406.4 * n**-0.34 + 410.7 * d**-0.28  # the Chinchilla fit
    law = fit_law(np.stack([n, d], axis=1), losses, variables=("N", "D"))
    assert law.predict(np.stack([n, d], axis=1)) == pytest.approx(losses, rel=1e-8)
    assert law.exponents == pytest.approx((0.34, 0.28), rel=1e-5)
    assert law.E == pytest.approx(1.69, rel=1e-5)
    both = predict_thetas(np.stack([law.theta, law.theta]), [[1e8, 1e10]])
    assert both.shape == (2, 1) and both[:, 0] == pytest.approx([1.69 + 406.4 * 1e8**-0.34 + 410.7 * 1e10**-0.28] * 2)


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

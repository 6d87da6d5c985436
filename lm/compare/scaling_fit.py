"""Scaling-law fits for `lm compare ladder`: architectures are compared by fitted curves with error bars, not by one
run each. After Hoffmann et al. 2022 (Chinchilla, approach 3) and Besiroglu et al. 2024 (its replication): a robust
fit of log loss, with bootstrap intervals.

    L = E + A_1 x_1^-alpha_1 + ... + A_k x_k^-alpha_k

k = 1 is L(C) = E + A C^-alpha (C: training FLOPs); k = 2 is L(N, D) = E + A N^-alpha + B D^-beta. A parameter vector
theta is (E, a_1, alpha_1, ..., a_k, alpha_k) with A_j = exp(a_j). E is a parameter with the bound E >= 0, not a log:
where the runs are best fitted by a pure power law the fit reaches E = 0 and says so, instead of running e = log E
towards minus infinity and stopping wherever its iterations end.

What is fitted is each rung's mean (a rung: the runs at one point, its seeds): log of the mean final loss, each rung
weighted by the variance of that log mean: the seeds' relative variance pooled over all rungs, over the rung's seed
count (with no seeds to pool, equal weights). So the fit and a held-out error are single numbers: with
the runs themselves, any curve that passes between a rung's two seeds fits as well as another under a robust loss.
The optimiser is scipy's `least_squares` (trust-region reflective, with bounds; E set to 0 where the law without
it fits as well) on the standardised residuals, with a Huber loss at HUBER_SCALE standard
errors (a rung the law misses by more than its noise counts linearly), from several starts; a fit whose every start
stopped at the evaluation cap is reported as not converged.

Intervals come from the "misfit" bootstrap (`bootstrap_laws`): a replicate is the fitted law at each rung, plus that
rung's residual with a random sign (inflated by sqrt(K / (K - p)) for K rungs and p parameters), plus the mean of the
rung's seed deviations drawn with replacement (inflated by sqrt(m / (m - 1)) for m seeds). Resampling seeds alone
measures only their noise; the residual term carries the law's misfit, which at the CPU ladder's rungs was several
times that noise. `python -m lm.compare.scaling_fit` measures its coverage (docs/ladder.md, "How far the intervals can
be trusted")."""

import math
from dataclasses import dataclass

import numpy as np

from lm.util.errors import UserError

HUBER_SCALE = 3.0  # standard errors of a rung's mean within which a residual counts quadratically
MAX_EVALUATIONS = 2000  # of the residuals, per start: a fit that reaches it has not converged
TOLERANCE = 1e-10  # least_squares' ftol, xtol and gtol
START_EXPONENTS = (0.1, 0.3, 0.6)
START_FLOORS = (1e-3, 0.5, 0.9)  # E as a share of the lowest loss (1e-3: near its bound 0)
MIN_DISTINCT = 3  # values of each variable: a curve E + A x^-alpha has three parameters
NOISE_FLOOR = 1e-9  # relative: seeds closer than this differ by rounding, not noise


def _power_terms(thetas: np.ndarray, x: np.ndarray) -> np.ndarray:
    """log of each power term, a_j - alpha_j x_j: (R, k, n) for thetas (R, 1 + 2k) and log variables x (k, n)."""
    return thetas[:, 1::2, None] - thetas[:, 2::2, None] * x[None]


def _values(thetas: np.ndarray, x: np.ndarray) -> np.ndarray:
    """L (R, n) of each theta at log variables x (k, n)."""
    with np.errstate(over="ignore"):
        return thetas[:, :1] + np.exp(_power_terms(thetas, x)).sum(axis=1)


def _as_matrix(values, k: int) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    return values[:, None] if values.ndim == 1 and k == 1 else values


def predict_thetas(thetas: np.ndarray, values) -> np.ndarray:
    """L (R, n) of each of thetas (R, 1 + 2k) at raw variables (n, k) (or (n,) for one variable)."""
    thetas = np.atleast_2d(np.asarray(thetas, dtype=float))
    return _values(thetas, np.log(_as_matrix(values, (thetas.shape[1] - 1) // 2)).T)


@dataclass(frozen=True, eq=False)  # eq=False: == of arrays has no single truth value
class Law:
    """A fitted law over `variables`, ("C",) or ("N", "D"), with theta = (E, a_1, alpha_1, ...); `converged`: the
    optimiser stopped on its tolerances, not on its evaluation cap."""

    variables: tuple[str, ...]
    theta: np.ndarray
    converged: bool = True

    @property
    def E(self) -> float:
        return float(self.theta[0])

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(float(v) for v in np.exp(self.theta[1::2]))

    @property
    def exponents(self) -> tuple[float, ...]:
        return tuple(float(v) for v in self.theta[2::2])

    def predict(self, values) -> np.ndarray:
        """L at raw variables, shape (n, k) (or (n,) for one variable)."""
        return predict_thetas(self.theta[None], values)[0]


@dataclass(frozen=True)
class Rungs:
    """The points a law is fitted to: each rung's variables (K, k; the mean of its runs'), the log of its mean loss
    (K,), that log mean's standard error (K,; None: equal weights), and its runs' log deviations from that mean."""

    values: np.ndarray
    log_means: np.ndarray
    errors: np.ndarray | None
    deviations: list[np.ndarray]
    labels: list


def _check(values: np.ndarray, losses: np.ndarray, variables: tuple[str, ...]) -> None:
    k = len(variables)
    if values.ndim != 2 or values.shape[1] != k or losses.shape != (len(values),):
        raise UserError(f"scaling fit: {losses.size} losses for values of shape {values.shape}, variables "
                        f"{', '.join(variables)}: need one loss per row of {k} value(s)")
    for name, column in zip(variables + ("loss",), [*values.T, losses]):
        if not (np.all(np.isfinite(column)) and np.all(column > 0)):
            raise UserError(f"scaling fit: every {name} must be positive and finite, got {column.min():g}")


def _check_fittable(values: np.ndarray, variables: tuple[str, ...]) -> None:
    """Enough distinct points for a law of 1 + 2k parameters, and enough distinct values of each variable."""
    need = 1 + 2 * len(variables)
    if len(np.unique(values, axis=0)) < need:
        raise UserError(f"scaling fit of L({', '.join(variables)}): {len(np.unique(values, axis=0))} distinct "
                        f"point(s), need at least {need}")
    for name, column in zip(variables, values.T):
        if len(np.unique(column)) < MIN_DISTINCT:
            raise UserError(f"scaling fit: {len(np.unique(column))} distinct value(s) of {name}, need at least "
                            f"{MIN_DISTINCT} to fit a curve in it")


def rungs_of(values, losses, groups=None, variables: tuple[str, ...] = ("C",)) -> Rungs:
    """The rung means of runs (values (n, k) or (n,), losses (n,)), grouped by `groups` (a label a run; None: runs at
    the same values form a rung), checked: one UserError line unless a law can be fitted to them."""
    variables = tuple(variables)
    if not variables:
        raise UserError("a scaling law needs at least one variable (C, or N and D)")
    values, losses = _as_matrix(values, len(variables)), np.asarray(losses, dtype=float)
    _check(values, losses, variables)
    if groups is None:
        _, labels = np.unique(values, axis=0, return_inverse=True)
    else:
        labels = np.asarray(groups)
        if labels.shape != (len(losses),):
            raise UserError(f"scaling fit: {labels.size} group labels for {len(losses)} runs")
    order = list(dict.fromkeys(labels.tolist()))
    members = [np.flatnonzero(labels == g) for g in order]
    points = np.array([values[m].mean(axis=0) for m in members])
    _check_fittable(points, variables)
    means = np.array([losses[m].mean() for m in members])
    deviations = [np.log(losses[m] / losses[m].mean()) for m in members]
    relative = [(len(m) - 1, losses[m].var(ddof=1) / losses[m].mean() ** 2) for m in members if len(m) > 1]
    relative = [(d, v if v > NOISE_FLOOR ** 2 else 0.0) for d, v in relative]  # rounding is no seed noise
    dof = sum(d for d, _ in relative)
    errors = None
    if dof and sum(d * v for d, v in relative) > 0:
        # One relative variance for all rungs (seed noise on log loss barely moves with size): a rung's own 2-3 seeds
        # give a variance with 1-2 degrees of freedom, and weighting by that under-covered (docs/ladder.md).
        pooled = sum(d * v for d, v in relative) / dof
        errors = np.sqrt([pooled / len(m) for m in members])
    return Rungs(points, np.log(means), errors, deviations, order)


def _starts(x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Starts in centred coordinates: each exponent in START_EXPONENTS (all combinations) crossed with E at
    START_FLOORS of the lowest loss; given those, each a_j by least squares on log((L - E) / k) = a_j - alpha_j x_j."""
    import itertools

    k = x.shape[0]
    loss = np.exp(y)
    starts = []
    for floor in START_FLOORS:
        e = floor * loss.min()
        excess = np.log((loss - e) / k)
        for exponents in itertools.product(START_EXPONENTS, repeat=k):
            theta = [e]
            for j, alpha in enumerate(exponents):
                theta += [float((excess + alpha * x[j]).mean()), alpha]
            starts.append(np.array(theta))
    return starts


def _solve(x: np.ndarray, y: np.ndarray, weights: np.ndarray, starts: list[np.ndarray],
           polish: bool) -> tuple[np.ndarray, bool]:
    """The best of least_squares' fits from `starts` (centred coordinates), and whether it converged; `polish`: E = 0
    exactly where the law without E, fitted from there, is as good (an interior method only approaches a bound)."""
    from scipy.optimize import least_squares

    def residuals(theta):
        value = _values(theta[None], x)[0]
        return (np.log(np.maximum(value, 1e-300)) - y) * weights

    def jacobian(theta):
        power = np.exp(_power_terms(theta[None], x)[0])  # (k, n)
        value = np.maximum(theta[0] + power.sum(axis=0), 1e-300)
        columns = [np.ones_like(value)]
        for j in range(x.shape[0]):
            columns += [power[j], -x[j] * power[j]]
        return np.stack(columns, axis=1) / value[:, None] * weights[:, None]

    lower = np.array([0.0] + [-np.inf, 0.0] * x.shape[0])

    def solve(fun, jac, start: np.ndarray, low: np.ndarray):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return least_squares(fun, start, jac=jac, bounds=(low, np.inf), loss="huber", f_scale=HUBER_SCALE,
                                 max_nfev=MAX_EVALUATIONS, ftol=TOLERANCE, xtol=TOLERANCE, gtol=TOLERANCE, method="trf")

    best = None
    for start in starts:
        found = solve(residuals, jacobian, start, lower)
        key = (found.status <= 0, found.cost)  # converged first, then the lowest objective
        if np.isfinite(found.cost) and (best is None or key < best[0]):
            best = (key, found)
    theta, converged, cost = best[1].x, best[1].status > 0, best[1].cost
    if polish:  # trf, an interior method, only approaches the bound: E = 0 where the law without E fits as well
        bound = lambda t: np.concatenate([[0.0], t])  # noqa: E731
        pure = solve(lambda t: residuals(bound(t)), lambda t: jacobian(bound(t))[:, 1:], theta[1:], lower[1:])
        if pure.status > 0 and pure.cost <= cost:
            theta = bound(pure.x)
    return theta, converged


def _fit(rungs: Rungs, y: np.ndarray | None = None, start: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """(raw theta, converged) of the law through `rungs` (or through log means `y` at the same points), from a start
    in raw coordinates or from every start of `_starts`."""
    x = np.log(rungs.values).T  # (k, K)
    centre = x.mean(axis=1)
    xc = x - centre[:, None]
    y = rungs.log_means if y is None else y
    weights = np.ones_like(y) if rungs.errors is None else 1 / rungs.errors
    if start is None:
        starts = _starts(xc, y)
    else:  # raw -> centred: a_j - alpha_j (x_j - m_j) = (a_j - alpha_j m_j) - alpha_j (x_j - m_j)
        start = start.copy()
        start[1::2] -= start[2::2] * centre
        starts = [start]
    theta, converged = _solve(xc, y, weights, starts, polish=start is None)
    theta = theta.copy()
    theta[1::2] += theta[2::2] * centre
    return theta, converged


def fit_law(values, losses, variables: tuple[str, ...] = ("C",), groups=None) -> Law:
    """The law through the rung means of runs (values (n, k), or (n,) for C alone; losses (n,); rungs: `groups`, or
    the runs at one point)."""
    rungs = rungs_of(values, losses, groups, variables)
    theta, converged = _fit(rungs)
    return Law(tuple(variables), theta, converged)


def bootstrap_laws(values, losses, groups=None, reps: int = 1000, seed: int = 0,
                   variables: tuple[str, ...] = ("C",)) -> tuple[np.ndarray, float]:
    """(thetas (reps, 1 + 2k) of "misfit" replicates, the share of them whose fit converged), deterministic from seed.
    A replicate's rung mean is the point fit's value there, plus the rung's residual with a random sign (inflated by
    sqrt(K / (K - p))), plus the mean of its seeds' log deviations drawn with replacement (inflated by
    sqrt(m / (m - 1)) for m seeds; none for a rung of one). Each is refitted from the point fit."""
    rungs = rungs_of(values, losses, groups, variables)
    theta, _ = _fit(rungs)
    fitted = np.log(_values(theta[None], np.log(rungs.values).T)[0])
    count, params = len(rungs.log_means), 1 + 2 * len(tuple(variables))
    inflation = math.sqrt(count / max(count - params, 1))
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(reps, count))
    replicates = fitted + signs * (rungs.log_means - fitted) * inflation
    for i, d in enumerate(rungs.deviations):
        if len(d) > 1:
            replicates[:, i] += d[rng.integers(len(d), size=(reps, len(d)))].mean(axis=1) * math.sqrt(
                len(d) / (len(d) - 1))
    thetas, converged = np.empty((reps, len(theta))), 0
    for r in range(reps):
        thetas[r], ok = _fit(rungs, replicates[r], theta)
        converged += ok
    return thetas, converged / reps


def held_out(values, losses, groups, variables: tuple[str, ...] = ("C",)) -> dict:
    """How well the law predicts a rung it was not fitted to, in nats: for each rung, the law through the other rungs'
    means, its prediction at this rung minus this rung's mean loss; None where the others cannot be fitted.
    "largest": the error at the rung of the largest compute, "rms" and "max" over every rung left out in turn."""
    values = _as_matrix(values, len(variables))
    losses, labels = np.asarray(losses, dtype=float), np.asarray(groups)
    order = sorted(set(labels.tolist()), key=lambda g: float(np.prod(values[labels == g].mean(axis=0))))
    errors = {}
    for g in order:
        keep = labels != g
        try:
            law = fit_law(values[keep], losses[keep], variables, labels[keep])
        except UserError:
            errors[g] = None
            continue
        errors[g] = float(law.predict(values[~keep].mean(axis=0, keepdims=True))[0] - losses[~keep].mean())
    found = [e for e in errors.values() if e is not None]
    return {"errors": errors, "largest_rung": order[-1], "largest": errors[order[-1]],
            "rms": math.sqrt(sum(e * e for e in found) / len(found)) if found else None,
            "max": max(map(abs, found)) if found else None}


def interval(samples: np.ndarray, level: float = 0.9) -> tuple[float, float]:
    """The percentile interval holding `level` of the samples; nan samples (a replicate whose curves do not cross)
    are left out, so a caller of crossovers also reports how many crossed."""
    samples = np.asarray(samples, dtype=float)
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return math.nan, math.nan
    lo, hi = np.quantile(finite, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


TRUTH = (1.8, 1000.0, 0.2)  # E, A, alpha of the coverage check: L from about 5.8 at 1e12 FLOPs to 2.4 at 1e16
RUNGS = np.logspace(12, 16, 6)
BROKEN = lambda c: TRUTH[0] + TRUTH[1] * c ** -TRUTH[2] * (1 + c / 1e14) ** -0.15  # noqa: E731
TRUTHS = {  # name -> (the truth L(C), its rungs, where its loss is checked): the law itself, and a law bent past
    # 1e14 FLOPs that it cannot fit (it misses the rungs near the bend by 2-3x the seeds' noise)
    "law, 6 rungs": (lambda c: TRUTH[0] + TRUTH[1] * c ** -TRUTH[2], RUNGS, 1e14),
    "law, 4 rungs": (lambda c: TRUTH[0] + TRUTH[1] * c ** -TRUTH[2], np.logspace(12, 14, 4), 1e13),
    "bent, 6 rungs": (BROKEN, RUNGS, 3e14),
}


def coverage(truth: str, draws: int, reps: int, seed: int, level: float = 0.9) -> np.ndarray:
    """Shares of `draws` data sets (a truth of TRUTHS at its rungs, 3 seeds a rung, log-normal noise of sigma 0.01)
    whose `level` intervals hold the true value: of alpha and E (the law's truths only: nan otherwise), and of the loss
    at the truth's point of check inside the rungs and at 10x past the largest."""
    rng = np.random.default_rng(seed)
    law, rungs, inside = TRUTHS[truth]
    c = np.repeat(rungs, 3)
    groups = np.repeat(np.arange(len(rungs)), 3)
    probes = np.array([inside, 10 * rungs[-1]])
    held = np.zeros(4)
    for draw in range(draws):
        losses = law(c) * np.exp(rng.normal(0, 0.01, c.size))
        thetas, _ = bootstrap_laws(c, losses, groups, reps, seed=draw)
        at = predict_thetas(thetas, probes)
        for i, (samples, true) in enumerate([(thetas[:, 2], TRUTH[2]), (thetas[:, 0], TRUTH[0]),
                                             (at[:, 0], law(probes[0])), (at[:, 1], law(probes[1]))]):
            lo, hi = interval(samples, level)
            held[i] += lo <= true <= hi
    shares = held / draws
    if truth.startswith("bent"):
        shares[:2] = math.nan
    return shares


if __name__ == "__main__":
    import sys

    draws = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    print(f"{'truth':<17}alpha   E       inside  10x past   ({draws} draws of 200 misfit replicates)")
    for truth in TRUTHS:
        print(f"{truth:<17}" + "   ".join(f"{x:.3f}" for x in coverage(truth, draws, 200, seed=1)), flush=True)

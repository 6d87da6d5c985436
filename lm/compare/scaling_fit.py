"""Scaling-law fits for `lm compare ladder`: architectures are compared by fitted curves with error bars, not by one
run each. After Hoffmann et al. 2022 (Chinchilla, approach 3) and Besiroglu et al. 2024 (its replication): a Huber
loss on log loss, with bootstrap intervals.

Every law is a log-sum-exp, so that E, A, B stay positive whatever the optimiser tries:

    log L = logsumexp(e, a_1 - alpha_1 x_1, ..., a_k - alpha_k x_k),   x_j = log(variable j)

k = 1 is L(C) = E + A C^-alpha (C: training FLOPs); k = 2 is L(N, D) = E + A N^-alpha + B D^-beta. A parameter vector
theta is (e, a_1, alpha_1, ..., a_k, alpha_k); E = exp(e), A = exp(a_1), B = exp(a_2).

The fit is a damped Newton method (Levenberg-Marquardt, with IRLS Huber weights: see _levenberg_marquardt) from
several starts, vectorised over many independent problems at once: that is what makes a bootstrap of a thousand
refits take well under a second.

Bootstrap method, chosen by measured coverage (`python -m lm.compare.scaling_fit` prints this table, in about 20
minutes on one core): truths TRUTHS (the law 1.8 + 1000 C^-0.2 at 6 rungs from 1e12 to 1e16 and at 4 rungs to 1e14;
the same law bent past 1e14, which E + A C^-alpha misses near the bend by 2-3x the noise), 3 seeds a rung,
multiplicative log-normal noise of sigma 0.01; 400 draws of 200 replicates each; the share of 90% percentile
intervals that held the true value (binomial sd 0.015) of alpha, E, the loss inside the rungs and 10x past them:

    truth            method                                  alpha   E       inside  10x past
    law, 6 rungs     cases, plain                            0.955   0.943   0.905   0.917
    law, 6 rungs     cases, stratified by rung               0.873   0.850   0.835   0.823
    law, 6 rungs     residuals, inflated by sqrt(n/(n-p))    0.835   0.835   0.858   0.840
    law, 6 rungs     misfit (the ladder's)                   0.958   0.948   0.935   0.935
    law, 4 rungs     cases, plain                            0.920   0.925   0.900   0.912
    law, 4 rungs     cases, stratified by rung               0.860   0.850   0.787   0.840
    law, 4 rungs     residuals, inflated by sqrt(n/(n-p))    0.863   0.848   0.833   0.840
    law, 4 rungs     misfit (the ladder's)                   0.975   0.963   0.953   0.958
    bent, 6 rungs    cases, plain                                            0.705   0.000
    bent, 6 rungs    cases, stratified by rung                               0.260   0.000
    bent, 6 rungs    residuals, inflated by sqrt(n/(n-p))                    0.613   0.003
    bent, 6 rungs    misfit (the ladder's)                                   0.905   0.033

The ladder's intervals are "misfit" (_misfit_rows): seeds resampled within each rung, plus each rung's mean residual
with a random sign. Where the law holds it errs wide, most with 4 rungs (one residual's worth of misfit to scale by);
where the law misses rungs it alone holds the loss inside the rungs at about its nominal rate, where resampling seeds
within rungs (the former default: closest to nominal on the law itself) holds it in a quarter of the draws. No form
holds a bend beyond the runs: that is what the held-out errors (held_out) are reported for. Plain case resampling errs
wide on the law: a replicate that misses the smallest or largest rung pins E and alpha down less. Residual resampling
errs narrow: a fit this close to least absolute deviations passes within delta of several points, so its residuals
understate the noise even after inflation.
"""

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from lm.util.errors import UserError

ITERATIONS = 100
START_EXPONENTS = (0.1, 0.3, 0.6)
START_FLOORS = (0.05, 0.5, 0.9)  # E as a share of the lowest loss: 0.05 lets a fit find E near its bound 0
MIN_DISTINCT = 3  # values of each variable: a curve E + A x^-alpha has three parameters
METHODS = ("cases", "residuals", "misfit")


def _terms(thetas: np.ndarray, xt: np.ndarray) -> list[np.ndarray]:
    """The log-sum-exp's terms e, a_j - alpha_j x_j, each (M, n), for thetas (M, 1 + 2k) and xt (M or 1, k, n).
    A list of arrays rather than one array with a short last axis: reductions over that axis are slow in numpy."""
    m, n = len(thetas), xt.shape[-1]
    return [np.broadcast_to(thetas[:, :1], (m, n))] + [
        thetas[:, 1 + 2 * j, None] - thetas[:, 2 + 2 * j, None] * xt[:, j] for j in range(xt.shape[1])]


def _logsumexp(terms: list[np.ndarray]) -> np.ndarray:
    top = functools.reduce(np.maximum, terms)
    top = np.where(np.isfinite(top), top, 0.0)
    return top + np.log(sum(np.exp(t - top) for t in terms))


def _log_law(thetas: np.ndarray, xt: np.ndarray) -> np.ndarray:
    return _logsumexp(_terms(thetas, xt))


def _huber(r: np.ndarray, delta: float) -> np.ndarray:
    size = np.abs(r)
    return np.where(size <= delta, 0.5 * r * r, delta * (size - 0.5 * delta)).sum(axis=-1)


def _solve(h: np.ndarray, g: np.ndarray) -> np.ndarray:
    """h^-1 g for a stack; one singular matrix would stop np.linalg.solve for all, so those take the pseudo-inverse."""
    try:
        return np.linalg.solve(h, g[..., None])[..., 0]
    except np.linalg.LinAlgError:
        return (np.linalg.pinv(h) @ g[..., None])[..., 0]


def _levenberg_marquardt(thetas: np.ndarray, xt: np.ndarray, y: np.ndarray, delta: float, iterations: int):
    """Minimises each problem's Huber objective from its start; returns (thetas, objectives).

    A step solves (Jw' J + lambda Jw J) step = -J' psi(r): Newton on the Huber objective, whose curvature comes only
    from the points within delta (w' = 1 there, 0 elsewhere), damped per problem by lambda times the IRLS matrix
    (w = min(1, delta / |r|)), lambda shrinking on an accepted step and growing on a rejected one. Damping by the
    diagonal instead (plain Levenberg-Marquardt on the IRLS matrix) crawls when the fit passes through fewer distinct
    points than it has parameters, as bootstrap replicates with repeated runs often do: after 300 iterations 1% of
    them were still off, by up to two standard errors in alpha. Here lambda -> 0 takes the long Newton step along such a
    valley, and the IRLS matrix bounds it far from the optimum, where few points lie within delta.
    A problem leaves the working set once a step gains nothing (or no damping finds a better point)."""
    thetas = thetas.copy()
    k = xt.shape[1]
    objective = _huber(_log_law(thetas, xt) - y, delta)
    objective = np.where(np.isfinite(objective), objective, np.inf)
    damping = np.ones(len(thetas))
    active = np.flatnonzero(np.isfinite(objective))
    for _ in range(iterations):
        if active.size == 0:
            break
        th, xa, ya, lam, old = thetas[active], xt[active], y[active], damping[active], objective[active]
        terms = _terms(th, xa)
        log_l = _logsumexp(terms)
        r = log_l - ya
        shares = [np.exp(t - log_l) for t in terms]  # softmax: d log L / d (each term)
        columns = [shares[0]]
        for j in range(k):
            columns += [shares[1 + j], -shares[1 + j] * xa[:, j]]
        jac = np.stack(columns, axis=1)  # (M, 1 + 2k, n): d log L / d (e, a_1, alpha_1, ...)
        jac_t = jac.transpose(0, 2, 1)
        inside = np.abs(r) <= delta
        weight = np.where(inside, 1.0, delta / np.maximum(np.abs(r), delta))  # IRLS weights of Huber
        curvature = (jac * inside[:, None, :]) @ jac_t
        metric = (jac * weight[:, None, :]) @ jac_t
        gradient = (jac @ np.clip(r, -delta, delta)[..., None])[..., 0]
        trial = th - _solve(curvature + lam[:, None, None] * metric, gradient)
        new = _huber(_log_law(trial, xa) - ya, delta)
        better = new < old  # nan is never better
        thetas[active[better]] = trial[better]
        objective[active[better]] = new[better]
        damping[active] = np.clip(np.where(better, lam / 3, lam * 8), 1e-12, 1e16)
        stalled = better & (old - new <= 1e-12 * old)
        hopeless = ~better & (lam >= 1e12)
        active = active[~(stalled | hopeless | (objective[active] == 0))]
    return thetas, objective


def _starts(xc: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Starts (B, S, 1 + 2k) in centred coordinates: each exponent in START_EXPONENTS (all combinations) crossed with
    E in START_FLOORS x min(L); given those, each a_j by least squares on log((L - E) / k) = a_j - alpha_j x_j."""
    b, k, _ = xc.shape
    loss = np.exp(y)
    starts = []
    for floor in START_FLOORS:
        e_start = floor * loss.min(axis=1)
        excess = np.log((loss - e_start[:, None]) / k)
        for exponents in itertools.product(START_EXPONENTS, repeat=k):
            theta = np.empty((b, 1 + 2 * k))
            theta[:, 0] = np.log(e_start)
            for j, alpha in enumerate(exponents):
                theta[:, 1 + 2 * j] = (excess + alpha * xc[:, j]).mean(axis=1)
                theta[:, 2 + 2 * j] = alpha
            starts.append(theta)
    return np.stack(starts, axis=1)


def fit_thetas(x: np.ndarray, y: np.ndarray, delta: float = 1e-3) -> np.ndarray:
    """Huber(delta) fits of log loss for B independent problems at once: x (B, n, k) log variables, y (B, n) log
    losses; returns thetas (B, 1 + 2k), each problem's best over several starts. x is centred per problem inside
    (a_j absorbs the shift), which keeps the normal equations well conditioned."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    b, n, k = x.shape
    centre = x.mean(axis=1)
    xc = np.ascontiguousarray((x - centre[:, None, :]).transpose(0, 2, 1))  # (B, k, n)
    starts = _starts(xc, y)
    s = starts.shape[1]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a wild trial step is rejected, not reported
        thetas, objective = _levenberg_marquardt(
            starts.reshape(b * s, -1), np.repeat(xc, s, axis=0), np.repeat(y, s, axis=0), delta, ITERATIONS)
    best = np.argmin(objective.reshape(b, s), axis=1)
    thetas = thetas.reshape(b, s, -1)[np.arange(b), best]
    thetas[:, 1::2] += thetas[:, 2::2] * centre  # a_j - alpha_j (x_j - m_j) = (a_j + alpha_j m_j) - ...
    return thetas


def _as_matrix(values, k: int) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    return values[:, None] if values.ndim == 1 and k == 1 else values


def _checked(values, losses, variables: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Raw variables (n, k) and losses (n,), refused in one line unless a law can be fitted to them."""
    k = len(variables)
    if k == 0:
        raise UserError("a scaling law needs at least one variable (C, or N and D)")
    values, losses = _as_matrix(values, k), np.asarray(losses, dtype=float)
    if values.ndim != 2 or values.shape[1] != k or losses.shape != (len(values),):
        raise UserError(f"scaling fit: {losses.size} losses for values of shape {values.shape}, variables "
                        f"{', '.join(variables)}: need one loss per row of {k} value(s)")
    for name, column in zip(variables + ("loss",), [*values.T, losses]):
        if not (np.all(np.isfinite(column)) and np.all(column > 0)):
            raise UserError(f"scaling fit: every {name} must be positive and finite, got {column.min():g}")
    need = 1 + 2 * k
    if len(losses) < need or len(np.unique(values, axis=0)) < need:
        raise UserError(f"scaling fit of L({', '.join(variables)}): {len(np.unique(values, axis=0))} distinct "
                        f"point(s), need at least {need}")
    for name, column in zip(variables, values.T):
        if len(np.unique(column)) < MIN_DISTINCT:
            raise UserError(f"scaling fit: {len(np.unique(column))} distinct value(s) of {name}, need at least "
                            f"{MIN_DISTINCT} to fit a curve in it")
    return values, losses


@dataclass(frozen=True, eq=False)  # eq=False: == of arrays has no single truth value
class Law:
    """A fitted law over `variables`, ("C",) or ("N", "D"), with theta = (e, a_1, alpha_1, ...)."""

    variables: tuple[str, ...]
    theta: np.ndarray

    @property
    def E(self) -> float:
        return float(np.exp(self.theta[0]))

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(float(v) for v in np.exp(self.theta[1::2]))

    @property
    def exponents(self) -> tuple[float, ...]:
        return tuple(float(v) for v in self.theta[2::2])

    def predict(self, values: np.ndarray) -> np.ndarray:
        """L at raw variables, shape (n, k) (or (n,) for one variable)."""
        return predict_thetas(self.theta[None], values)[0]


def fit_law(values, losses, variables: tuple[str, ...] = ("C",), delta: float = 1e-3) -> Law:
    """One Huber fit of log loss to raw variables (n, k) (or (n,) for C alone) and raw losses (n,)."""
    values, losses = _checked(values, losses, tuple(variables))
    return Law(tuple(variables), fit_thetas(np.log(values)[None], np.log(losses)[None], delta)[0])


def _distinct(ids: np.ndarray) -> np.ndarray:
    """Distinct entries of each row of ids (R, n)."""
    ordered = np.sort(ids, axis=1)
    return 1 + (np.diff(ordered, axis=1) != 0).sum(axis=1)


def _enough(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Which replicates (rows: R x n indices into values) can be fitted: enough distinct points and values."""
    _, point = np.unique(values, axis=0, return_inverse=True)
    ok = _distinct(point.reshape(-1)[rows]) >= 1 + 2 * values.shape[1]
    for column in values.T:
        ok &= _distinct(column[rows]) >= MIN_DISTINCT
    return ok


def _case_rows(values: np.ndarray, groups, reps: int, rng: np.random.Generator) -> np.ndarray:
    """Row indices (reps, n) of case-bootstrap replicates: within each group when every group has two rows or more
    (so each group is in every replicate), else over all rows; a replicate that cannot be fitted is drawn again."""
    n = len(values)
    members = [np.arange(n)]
    if groups is not None:
        labels = np.asarray(groups)
        if labels.shape != (n,):
            raise UserError(f"scaling fit: {labels.size} group labels for {n} runs")
        _, label = np.unique(labels, return_inverse=True)
        split = [np.flatnonzero(label == g) for g in range(label.max() + 1)]
        members = split if min(map(len, split)) >= 2 else members
    draw = lambda count: np.concatenate([m[rng.integers(len(m), size=(count, len(m)))] for m in members], axis=1)
    rows = draw(reps)
    for _ in range(100):
        bad = ~_enough(values, rows)
        if not bad.any():
            return rows
        rows[bad] = draw(int(bad.sum()))
    raise UserError(f"scaling fit: resampling {n} runs rarely gives enough distinct points to fit; add runs")


def _misfit_rows(x: np.ndarray, y: np.ndarray, groups, reps: int, rng: np.random.Generator, delta: float):
    """Log losses (reps, n) of "misfit" replicates: the fit's prediction at each run, plus its rung's mean residual
    (inflated by sqrt(K / (K - p)) for K rungs and p parameters) with a random sign, plus a seed deviation of that rung
    drawn with replacement (inflated by sqrt(m / (m - 1)) for m seeds). The rung term carries the law's misfit, which
    resampling seeds alone leaves out; with one run a rung it is the wild bootstrap of the residuals."""
    n = len(y)
    labels = np.asarray(groups) if groups is not None else np.arange(n)
    if labels.shape != (n,):
        raise UserError(f"scaling fit: {labels.size} group labels for {n} runs")
    fitted = _log_law(fit_thetas(x[None], y[None], delta), x.T[None])[0]
    members = [np.flatnonzero(labels == g) for g in np.unique(labels)]
    rungs, params = len(members), x.shape[1] * 2 + 1
    inflation = math.sqrt(rungs / max(rungs - params, 1))
    signs = rng.choice([-1.0, 1.0], size=(reps, rungs))
    out = np.empty((reps, n))
    for k, m in enumerate(members):
        mean = y[m].mean()
        deviation = (y[m] - mean) * (math.sqrt(len(m) / (len(m) - 1)) if len(m) > 1 else 0.0)
        misfit = (mean - fitted[m].mean()) * inflation
        out[:, m] = fitted[m] + signs[:, k:k + 1] * misfit + deviation[rng.integers(len(m), size=(reps, len(m)))]
    return out


def bootstrap_laws(values, losses, groups=None, reps: int = 1000, seed: int = 0, variables: tuple[str, ...] = ("C",),
                   method: str = "cases", delta: float = 1e-3) -> np.ndarray:
    """Thetas (reps, 1 + 2k) of refits to resampled data, deterministic from seed. method "cases" (see the module
    docstring for its coverage) resamples runs, within each of `groups` (one label a run, e.g. the rung) when given
    and every group has two runs or more; "residuals" adds resampled residuals of the fit, inflated by
    sqrt(n / (n - p)), to its predictions, and ignores groups; "misfit" (the ladder's: see _misfit_rows) resamples
    seeds within each group and adds each group's mean residual with a random sign, so that the intervals hold the
    law's misfit as well as the seeds' noise."""
    if method not in METHODS:
        raise UserError(f"scaling fit: unknown bootstrap method {method!r}, expected one of {', '.join(METHODS)}")
    values, losses = _checked(values, losses, tuple(variables))
    x, y = np.log(values), np.log(losses)
    rng = np.random.default_rng(seed)
    n, k = x.shape
    if method == "cases":
        rows = _case_rows(values, groups, reps, rng)
        return fit_thetas(x[rows], y[rows], delta)
    if method == "misfit":
        return fit_thetas(np.broadcast_to(x, (reps, n, k)), _misfit_rows(x, y, groups, reps, rng, delta), delta)
    fitted = _log_law(fit_thetas(x[None], y[None], delta), x.T[None])[0]
    residuals = (y - fitted) * math.sqrt(n / max(n - (1 + 2 * k), 1))
    resampled = fitted + residuals[rng.integers(n, size=(reps, n))]
    return fit_thetas(np.broadcast_to(x, (reps, n, k)), resampled, delta)


def held_out(values, losses, groups, delta: float = 1e-3) -> dict:
    """How well L(C) predicts a rung it was not fitted to, in nats: for each group (rung), the law fitted to the
    other groups' runs, its prediction at this rung's runs minus their losses (the mean over the rung); None where
    the others cannot be fitted. "largest": the error at the rung of the largest compute, "rms" and "max" over every
    rung left out in turn (leave one rung out)."""
    values, losses = np.asarray(values, dtype=float), np.asarray(losses, dtype=float)
    labels = np.asarray(groups)
    order = sorted(set(labels.tolist()), key=lambda g: float(values[labels == g].mean()))
    errors = {}
    for g in order:
        keep = labels != g
        try:
            law = fit_law(values[keep], losses[keep], delta=delta)
        except UserError:
            errors[g] = None
            continue
        errors[g] = float(np.mean(law.predict(values[~keep]) - losses[~keep]))
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


def predict_thetas(thetas: np.ndarray, values) -> np.ndarray:
    """L (R, n) of each of thetas (R, 1 + 2k) at raw variables (n, k) (or (n,) for one variable)."""
    thetas = np.atleast_2d(np.asarray(thetas, dtype=float))
    x = np.log(_as_matrix(values, (thetas.shape[1] - 1) // 2))
    return np.exp(_log_law(thetas, x.T[None]))


def crossovers(thetas_1: np.ndarray, thetas_2: np.ndarray, log_lo: float, log_hi: float,
               points: int = 1025) -> np.ndarray:
    """log C of the first crossing in [log_lo, log_hi] of laws L(C) thetas_1[i] and thetas_2[i], nan where they do
    not cross there: the first sign change of log L1 - log L2 on a grid of `points`, refined by bisection."""
    t1, t2 = np.atleast_2d(thetas_1).astype(float), np.atleast_2d(thetas_2).astype(float)
    if t1.shape != t2.shape or t1.shape[1] != 3:
        raise ValueError(f"crossovers pairs laws L(C) (thetas of 3), got shapes {t1.shape} and {t2.shape}")
    gap = lambda log_c: np.sign(_log_law(t1, log_c[:, None]) - _log_law(t2, log_c[:, None]))
    grid = np.linspace(log_lo, log_hi, points)
    sign = gap(np.broadcast_to(grid, (len(t1), points)))
    change = sign[:, :-1] * sign[:, 1:] <= 0
    first = np.argmax(change, axis=1)
    lo, hi = grid[first], grid[first + 1]
    sign_lo = sign[np.arange(len(t1)), first]
    for _ in range(60):
        mid = (lo + hi) / 2
        same = gap(mid[:, None])[:, 0] == sign_lo
        lo, hi = np.where(same, mid, lo), np.where(same, hi, mid)
    root = np.where(sign_lo == 0, grid[first], (lo + hi) / 2)
    return np.where(change.any(axis=1), root, np.nan)


def crossover(theta_1: np.ndarray, theta_2: np.ndarray, log_lo: float, log_hi: float) -> float | None:
    """log C (natural log) of the first point in [log_lo, log_hi] where laws L(C) theta_1 and theta_2 cross; None
    when they do not cross there."""
    root = crossovers(np.asarray(theta_1)[None], np.asarray(theta_2)[None], log_lo, log_hi)[0]
    return None if np.isnan(root) else float(root)


TRUTH = (1.8, 1000.0, 0.2)  # E, A, alpha of the coverage check: L from about 5.8 at 1e12 FLOPs to 2.4 at 1e16
RUNGS = np.logspace(12, 16, 6)
BROKEN = lambda c: TRUTH[0] + TRUTH[1] * c ** -TRUTH[2] * (1 + c / 1e14) ** -0.15  # noqa: E731
TRUTHS = {  # name -> (the truth L(C), its rungs, where its loss is checked): the law itself, and a law bent past
    # 1e14 FLOPs that it cannot fit (it misses the rungs near the bend by 2-3x the seeds' noise)
    "law, 6 rungs": (lambda c: TRUTH[0] + TRUTH[1] * c ** -TRUTH[2], RUNGS, 1e14),
    "law, 4 rungs": (lambda c: TRUTH[0] + TRUTH[1] * c ** -TRUTH[2], np.logspace(12, 14, 4), 1e13),
    "bent, 6 rungs": (BROKEN, RUNGS, 3e14),
}


def _coverage(method: str, stratified: bool, draws: int, reps: int, seed: int, level: float = 0.9,
              truth: str = "law, 6 rungs"):
    """Shares of `draws` data sets (a truth of TRUTHS at its rungs, 3 seeds a rung, log-normal noise of sigma 0.01)
    whose `level` intervals hold the true value: of alpha and E (the law's truths only: nan otherwise), and of the loss
    at the truth's point of check inside the rungs and at 10x past the largest."""
    rng = np.random.default_rng(seed)
    law, rungs, inside = TRUTHS[truth]
    c = np.repeat(rungs, 3)
    groups = np.repeat(np.arange(len(rungs)), 3) if stratified else None
    probes = np.array([inside, 10 * rungs[-1]])
    held = np.zeros(4)
    for draw in range(draws):
        losses = law(c) * np.exp(rng.normal(0, 0.01, c.size))
        thetas = bootstrap_laws(c, losses, groups, reps, seed=draw, method=method)
        at = predict_thetas(thetas, probes)
        for i, (samples, true) in enumerate([(thetas[:, 2], TRUTH[2]), (np.exp(thetas[:, 0]), TRUTH[0]),
                                             (at[:, 0], law(probes[0])), (at[:, 1], law(probes[1]))]):
            lo, hi = interval(samples, level)
            held[i] += lo <= true <= hi
    shares = held / draws
    if truth.startswith("bent"):
        shares[:2] = math.nan
    return shares


if __name__ == "__main__":
    print(f"{'truth':<17}{'method':<40}alpha   E       inside  10x past")
    for truth in TRUTHS:
        for name, method, stratified in [("cases, plain", "cases", False),
                                         ("cases, stratified by rung", "cases", True),
                                         ("residuals, inflated by sqrt(n/(n-p))", "residuals", False),
                                         ("misfit (the ladder's)", "misfit", True)]:
            shares = _coverage(method, stratified, draws=400, reps=200, seed=1, truth=truth)
            print(f"{truth:<17}{name:<40}" + "   ".join(f"{x:.3f}" for x in shares), flush=True)

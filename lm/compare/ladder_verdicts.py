"""What a ladder may say about two architectures (docs/design.md, "What a comparison may claim").

Only where both have runs. An architecture is read at a compute C only inside its own measured range, from its first
rung's compute to its last's: at a rung, that rung's mean final loss with its seed variance; between two rungs, the
straight line in log C between them, with an interval at least as wide as the wider of the two rungs' (the larger
variance, the fewer degrees of freedom) plus the line's own error, estimated from the rungs themselves: the miss of
each rung from the line through its two neighbours (leave one rung out) gives a curvature, and the line's error at C
is half that curvature times (log C - log C_i)(log C_i+1 - log C). With fewer than three rungs there is no such
estimate, and no reading between rungs. Two runs at computes within MATCHED (2%) of each other are compared as matched
(a head-to-head), each at its own rung; nothing else is read past a run.

The gap in nats is read with its interval: Student's t at Welch-Satterthwaite's degrees of freedom (at a reading
between rungs, the fewest degrees of freedom of any term, which keeps it no narrower than at either rung), plus the two
lines' errors. The verdict names the lower one only over the computes where that interval excludes 0, says where the
two cannot be told apart, names the rungs a verdict lies between when it holds at no rung, and says where the point
gap changes sign.

Beyond the measured range only the fitted curves speak, and only labelled: "extrapolated, k x past the largest run",
with each fit's held-out error (the error of predicting its largest rung from the others). No verdict there carries
a share of bootstrap replicates, and none names the architecture that the point estimates put behind."""

import math
from dataclasses import dataclass

import numpy as np

from lm.compare.plan import sci

MATCHED = 1.02  # computes within 2% count as the same (as lm compare plan matches within 2%)
STEPS_BETWEEN = 8  # computes read between two rungs, to find where the verdict changes
SAME = 1e-9  # relative: a compute this close to a rung's is that rung's


def t_quantile(p: float, df: float) -> float:
    """The p quantile of Student's t with df degrees of freedom (scipy's)."""
    from scipy.stats import t

    return float(t.ppf(p, df))


def welch_df(terms: list[tuple[float, float]]) -> float:
    """Welch-Satterthwaite's degrees of freedom of a sum of variances (variance, its degrees of freedom)."""
    total = sum(v for v, _ in terms)
    return total * total / sum(v * v / dof for v, dof in terms if v > 0) if total > 0 else math.inf


@dataclass(frozen=True)
class RungMean:
    """One rung of one architecture: its compute (the mean of its runs'), and the mean, variance and count of its
    seeds' final losses (diverged runs left out)."""

    rung: str
    compute: float
    mean: float
    var: float | None  # None: one seed
    n: int


def rung_means(rows: list[dict]) -> list[RungMean]:
    """The rungs of one architecture's runs (rows: compute, loss, rung), by compute."""
    by_rung: dict[str, list[dict]] = {}
    for row in rows:
        if math.isfinite(row["loss"]):
            by_rung.setdefault(row["rung"], []).append(row)
    means = []
    for rung, runs in by_rung.items():
        losses = np.array([r["loss"] for r in runs])
        means.append(RungMean(rung, float(np.mean([r["compute"] for r in runs])), float(losses.mean()),
                              float(losses.var(ddof=1)) if len(runs) > 1 else None, len(runs)))
    return sorted(means, key=lambda m: m.compute)


def pooled(means: list[RungMean]) -> tuple[float, float] | None:
    """(variance, degrees of freedom) of one seed's loss pooled over the rungs with two seeds or more."""
    dof = sum(m.n - 1 for m in means if m.var is not None)
    return (sum((m.n - 1) * m.var for m in means if m.var is not None) / dof, dof) if dof else None


def rung_term(means: list[RungMean], j: int) -> tuple[float, float]:
    """(the variance of rung j's mean, its degrees of freedom); a rung of one seed takes the variance pooled over
    the others' seeds; (nan, 0) where there is none to pool."""
    m = means[j]
    var, dof = (m.var, m.n - 1) if m.var is not None else pooled(means) or (math.nan, 0)
    return var / m.n, dof


def curvature(means: list[RungMean], segment: int) -> float | None:
    """The line's error scale over the segment from rung `segment` to the next: the largest |e| x 2 / (h1 h2) of the
    interior rungs at either end of it (e: the rung's mean minus the line through its two neighbours, in log C;
    h1, h2: its distances to them). None with fewer than 3 rungs."""
    if len(means) < 3:
        return None
    x = [math.log(m.compute) for m in means]
    found = []
    for j in (segment, segment + 1):
        if 0 < j < len(means) - 1:
            h1, h2 = x[j] - x[j - 1], x[j + 1] - x[j]
            line = means[j - 1].mean + (means[j + 1].mean - means[j - 1].mean) * h1 / (h1 + h2)
            found.append(2 * abs(means[j].mean - line) / (h1 * h2))
    return max(found)


@dataclass(frozen=True)
class Reading:
    """An architecture's mean loss at a compute, with the variance terms of its seed interval, the straight line's
    error there (nats, 0 at a rung) and the rungs it lies between (one rung: at it)."""

    mean: float
    terms: list[tuple[float, float]]
    line_error: float
    rungs: tuple[str, ...]


def read(means: list[RungMean], compute: float) -> Reading | None:
    """The reading at `compute`: at a rung, or between two (see the module docstring); None outside the range from
    the first rung's compute to the last's, and between rungs with no estimate of the line's error."""
    x = math.log(compute)
    logs = [math.log(m.compute) for m in means]
    for j, at in enumerate(logs):
        if abs(x - at) <= SAME:
            return Reading(means[j].mean, [rung_term(means, j)], 0.0, (means[j].rung,))
    if not logs[0] < x < logs[-1]:
        return None
    i = int(np.searchsorted(logs, x)) - 1
    scale = curvature(means, i)
    if scale is None:
        return None
    w = (x - logs[i]) / (logs[i + 1] - logs[i])
    (v1, d1), (v2, d2) = rung_term(means, i), rung_term(means, i + 1)
    return Reading((1 - w) * means[i].mean + w * means[i + 1].mean, [(max(v1, v2), min(d1, d2))],
                   0.5 * scale * (x - logs[i]) * (logs[i + 1] - x), (means[i].rung, means[i + 1].rung))


def gap_of(first: Reading, second: Reading, compute: float, level: float) -> dict:
    """L_first - L_second (nats) with its interval: t at Welch-Satterthwaite's degrees of freedom (at a reading
    between rungs, the fewest of the terms'), plus both lines' errors."""
    gap, terms = first.mean - second.mean, first.terms + second.terms
    found = {"compute": compute, "gap": gap, "rungs": (first.rungs, second.rungs),
             "line_error": first.line_error + second.line_error}
    if any(math.isnan(v) or dof == 0 for v, dof in terms):
        return {**found, "low": math.nan, "high": math.nan, "df": 0.0}
    var = sum(v for v, _ in terms)
    between = len(first.rungs) > 1 or len(second.rungs) > 1
    df = min(dof for _, dof in terms) if between else welch_df(terms)
    half = (t_quantile((1 + level) / 2, df) * math.sqrt(var) if var > 0 else 0.0) + found["line_error"]
    return {**found, "low": gap - half, "high": gap + half, "df": df}


def measured_range(means: list[RungMean]) -> tuple[float, float]:
    return means[0].compute, means[-1].compute


def matched_pairs(first: list[RungMean], second: list[RungMean]) -> list[tuple[RungMean, RungMean]]:
    """Rungs of the two at computes within MATCHED of each other (and not the same compute)."""
    apart = lambda a, b: abs(math.log(a.compute / b.compute))  # noqa: E731
    return [(a, b) for a in first for b in second if SAME < apart(a, b) <= math.log(MATCHED)]


def side(gap: dict) -> int:
    """-1: the first is lower (its interval below 0), +1: the second, 0: cannot tell."""
    return -1 if gap["high"] < 0 else 1 if gap["low"] > 0 else 0


def readings(first: list[RungMean], second: list[RungMean], level: float) -> list[dict]:
    """The gap at every compute where both can be read: each matched pair of rungs (at their geometric mean compute,
    each at its own rung), and over the range both were measured over, every rung's compute of either and
    STEPS_BETWEEN computes between consecutive ones (each flagged `at_rung` where it is a rung's compute)."""
    found = []
    for a, b in matched_pairs(first, second):
        c = math.sqrt(a.compute * b.compute)
        found.append({**gap_of(read(first, a.compute), read(second, b.compute), c, level), "at_rung": True,
                      "matched": True})
    lo = max(measured_range(first)[0], measured_range(second)[0])
    hi = min(measured_range(first)[1], measured_range(second)[1])
    if lo <= hi:
        rungs = sorted({lo, hi, *[m.compute for m in first + second if lo <= m.compute <= hi]})
        dense = sorted({float(c) for a, b in zip(rungs, rungs[1:]) for c in np.geomspace(a, b, STEPS_BETWEEN + 1)}
                       | set(rungs))
        near = [g["compute"] for g in found]
        for c in dense:
            if any(abs(math.log(c / m)) <= math.log(MATCHED) for m in near):
                continue  # compared there as a matched pair
            r1, r2 = read(first, c), read(second, c)
            if r1 is not None and r2 is not None:
                at_rung = any(abs(math.log(c / m.compute)) <= SAME for m in first + second)
                found.append({**gap_of(r1, r2, c, level), "at_rung": at_rung, "matched": False})
    return sorted(found, key=lambda g: g["compute"])


def compare(names: tuple[str, str], first: list[RungMean], second: list[RungMean], level: float) -> dict:
    """Two architectures over the computes where both can be read: the gap at each rung compute of either (with its
    interval), the verdict in segments, and where the point gap changes sign."""
    gaps = readings(first, second, level)
    if not gaps:
        return {"pair": names, "range": None, "gaps": [], "segments": [], "crossings": [],
                "verdict": "no compute where both can be read (each only inside its own runs): " + ", ".join(
                    f"{n} {sci(m[0].compute)} to {sci(m[-1].compute)}" for n, m in zip(names, (first, second)))}
    segments = []  # [side, from, to, [the gaps in it]]
    for gap in gaps:
        s = side(gap)
        if segments and segments[-1][0] == s:
            segments[-1][2] = gap["compute"]
            segments[-1][3].append(gap)
        else:
            segments.append([s, gap["compute"], gap["compute"], [gap]])
    for i, segment in enumerate(segments):  # where they cannot be told apart reaches to where a verdict holds
        if segment[0] == 0:
            segment[1] = segments[i - 1][2] if i else segment[1]
            segment[2] = segments[i + 1][1] if i + 1 < len(segments) else segment[2]
    crossings = []
    for a, b in zip(gaps, gaps[1:]):
        if a["gap"] * b["gap"] < 0:
            w = a["gap"] / (a["gap"] - b["gap"])
            crossings.append(math.exp(math.log(a["compute"]) + w * (math.log(b["compute"]) - math.log(a["compute"]))))
    return {"pair": names, "range": (gaps[0]["compute"], gaps[-1]["compute"]),
            "gaps": [g for g in gaps if g["at_rung"]], "segments": [s[:3] for s in segments],
            "crossings": crossings, "verdict": verdict_text(names, segments, gaps)}


def between_rungs(names: tuple[str, str], gaps: list[dict]) -> str:
    """Which rungs of each a verdict that holds at no rung lies between."""
    parts = []
    for k, name in enumerate(names):
        labels = list(dict.fromkeys(label for g in gaps for label in g["rungs"][k]))
        parts.append(f"{name}'s {labels[0]} and {labels[-1]}" if len(labels) > 1 else f"{name}'s {labels[0]}")
    return "only between rungs: " + ", ".join(parts)


def verdict_text(names: tuple[str, str], segments: list, gaps: list[dict]) -> str:
    if any(math.isnan(g["low"]) for g in gaps):
        return "one seed: no interval (a rung of one seed, and no other rung's seeds to pool)"
    parts = []
    for s, start, end, inside in segments:
        where = f"at {sci(start)}" if end / start <= MATCHED ** 2 else f"from {sci(start)} to {sci(end)}"
        if s == 0:
            parts.append(f"cannot tell {where}")
            continue
        lower, higher = names if s < 0 else names[::-1]
        text = f"{lower} lower than {higher} {where}"
        if not any(g["at_rung"] for g in inside):
            text += f" ({between_rungs(names, inside)})"
        parts.append(text)
    return "; ".join(parts)


def times(factor: float) -> str:
    """How far past a run: "109x", "3.2x"."""
    return f"{factor:,.0f}x" if factor >= 10 else f"{factor:.2g}x"


def extrapolated(names: tuple[str, str], fits: tuple[dict, dict], compute: float, span: tuple[float, float] | None,
                 largest: tuple[float, float]) -> dict | None:
    """The fitted curves at `compute` beyond the range both were measured over: the gap of the point fits (nats),
    labelled with how far past the largest run each is read and each fit's held-out error. It names the lower curve
    only where the gap exceeds the sum of the two held-out errors."""
    if span is not None and compute <= span[1]:
        return None
    if not all("theta" in f for f in fits):
        return {"pair": names, "compute": compute, "reading": "no fitted curve to read: "
                + "; ".join(f"{n}: {f['why']}" for n, f in zip(names, fits) if "why" in f)}
    from lm.compare.scaling_fit import predict_thetas

    losses = [float(predict_thetas(np.array(f["theta"]), np.array([compute]))[0, 0]) for f in fits]
    gap = losses[0] - losses[1]
    past = [compute / c for c in largest]
    errors = [f.get("held_out", {}).get("largest") for f in fits]
    label = (f"extrapolated, {times(max(past))} past the largest run ({names[0]} {times(past[0])}, {names[1]} "
             f"{times(past[1])})")
    if any(e is None for e in errors):
        reading = "cannot tell: no held-out error (a fit needs 3 rungs besides the one held out)"
    elif not all(f.get("converged", True) for f in fits):
        reading = "cannot tell: a fit did not converge"
    elif abs(gap) <= abs(errors[0]) + abs(errors[1]):
        reading = (f"cannot tell: the curves' gap, {abs(gap):.3f} nats, is within their held-out errors "
                   f"({abs(errors[0]):.3f} + {abs(errors[1]):.3f} nats)")
    else:
        lower = names[0] if gap < 0 else names[1]
        reading = (f"{lower}'s curve lower by {abs(gap):.3f} nats, more than the held-out errors "
                   f"({abs(errors[0]):.3f} + {abs(errors[1]):.3f} nats)")
    return {"pair": names, "compute": compute, "label": label, "losses": losses, "gap": gap,
            "held_out": errors, "reading": reading}

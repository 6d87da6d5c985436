"""What a ladder may say about two architectures (docs/design.md, "What a comparison may claim").

Inside the measured range, where both have runs: each one's mean final loss at a compute C is interpolated linearly
in log C between its own two rungs around C, and the gap in nats is read with its seed interval (Student's t, the
seeds' variance at each rung, Welch's degrees of freedom). The verdict names the lower one only over the computes
where that interval excludes 0, and says where the two cannot be told apart; a crossing is where the point gap
changes sign. A rung's compute is the mean of its runs'; computes within MATCHED (2%) of a range's end count as inside
it, so that runs at one budget (a head-to-head) compare.

Beyond the measured range only the fitted curves speak, and only labelled: "extrapolated, k x past the largest run",
with each fit's held-out error (the error of predicting its largest rung from the others). No verdict there carries
a share of bootstrap replicates, and none names the architecture that the point estimates put behind."""

import math
from dataclasses import dataclass

import numpy as np

from lm.compare.plan import sci

MATCHED = 1.02  # computes within 2% count as the same (as lm compare plan matches within 2%)
STEPS_BETWEEN = 8  # computes read between two rungs, to find where the verdict changes


def t_quantile(p: float, df: float) -> float:
    """The p quantile of Student's t with df degrees of freedom (scipy's)."""
    from scipy.stats import t

    return float(t.ppf(p, df))


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


def interpolated(means: list[RungMean], compute: float) -> tuple[float, list[tuple[float, float]]]:
    """(the mean loss at `compute`, linear in log C between the two rungs around it (an end's value within MATCHED of
    it), and the variance terms of that mean with their degrees of freedom)."""
    logs = [math.log(m.compute) for m in means]
    x = min(max(math.log(compute), logs[0]), logs[-1])
    i = min(max(int(np.searchsorted(logs, x, side="right")) - 1, 0), len(means) - 1)
    weights = [(i, 1.0)]
    if i + 1 < len(means) and x > logs[i]:
        w = (x - logs[i]) / (logs[i + 1] - logs[i])
        weights = [(i, 1 - w), (i + 1, w)]
    pool = pooled(means)
    terms = []
    for j, w in weights:
        var, dof = (means[j].var, means[j].n - 1) if means[j].var is not None else pool or (math.nan, 0)
        terms.append((w * w * var / means[j].n, dof))
    return sum(w * means[j].mean for j, w in weights), terms


def gap_at(first: list[RungMean], second: list[RungMean], compute: float, level: float) -> dict:
    """L_first - L_second at `compute` (nats) with its seed interval: t at Welch-Satterthwaite's degrees of freedom."""
    m1, t1 = interpolated(first, compute)
    m2, t2 = interpolated(second, compute)
    gap, terms = m1 - m2, t1 + t2
    if any(math.isnan(v) or dof == 0 for v, dof in terms):
        return {"compute": compute, "gap": gap, "low": math.nan, "high": math.nan, "df": 0.0}
    var = sum(v for v, _ in terms)
    df = var * var / sum(v * v / dof for v, dof in terms if v > 0) if var > 0 else math.inf
    half = t_quantile((1 + level) / 2, df) * math.sqrt(var) if var > 0 else 0.0
    return {"compute": compute, "gap": gap, "low": gap - half, "high": gap + half, "df": df}


def measured_range(means: list[RungMean]) -> tuple[float, float]:
    return means[0].compute / MATCHED, means[-1].compute * MATCHED


def both_measured(first: list[RungMean], second: list[RungMean]) -> tuple[float, float] | None:
    lo = max(measured_range(first)[0], measured_range(second)[0])
    hi = min(measured_range(first)[1], measured_range(second)[1])
    return (lo, hi) if lo <= hi else None


def side(gap: dict) -> int:
    """-1: the first is lower (its interval below 0), +1: the second, 0: cannot tell."""
    return -1 if gap["high"] < 0 else 1 if gap["low"] > 0 else 0


def compare(names: tuple[str, str], first: list[RungMean], second: list[RungMean], level: float) -> dict:
    """Two architectures over the computes where both have runs: the gap at each rung compute of either (with its
    interval), the verdict in segments, and where the point gap changes sign."""
    span = both_measured(first, second)
    if span is None:
        return {"pair": names, "range": None, "gaps": [], "segments": [], "crossings": [],
                "verdict": "no compute where both have runs: " + ", ".join(
                    f"{n} {sci(m[0].compute)} to {sci(m[-1].compute)}" for n, m in zip(names, (first, second)))}
    lo, hi = span
    rungs = sorted({lo, hi, *[m.compute for m in first + second if lo <= m.compute <= hi]})
    if rungs[-1] / rungs[0] <= MATCHED ** 2:  # one matched compute (a head-to-head)
        rungs = [math.sqrt(lo * hi)]
    dense = sorted({float(c) for a, b in zip(rungs, rungs[1:]) for c in np.geomspace(a, b, STEPS_BETWEEN + 1)}
                   | set(rungs))
    gaps = [gap_at(first, second, c, level) for c in dense]
    segments = []  # (side, from, to)
    for gap in gaps:
        s = side(gap)
        if segments and segments[-1][0] == s:
            segments[-1][2] = gap["compute"]
        else:
            segments.append([s, gap["compute"], gap["compute"]])
    for i, segment in enumerate(segments):  # where they cannot be told apart reaches to where a verdict holds
        if segment[0] == 0:
            segment[1] = segments[i - 1][2] if i else segment[1]
            segment[2] = segments[i + 1][1] if i + 1 < len(segments) else segment[2]
    crossings = []
    for a, b in zip(gaps, gaps[1:]):
        if a["gap"] * b["gap"] < 0:
            w = a["gap"] / (a["gap"] - b["gap"])
            crossings.append(math.exp(math.log(a["compute"]) + w * (math.log(b["compute"]) - math.log(a["compute"]))))
    at_rungs = [g for g in gaps if any(abs(math.log(g["compute"] / c)) < 1e-9 for c in rungs)]
    return {"pair": names, "range": span, "gaps": at_rungs, "segments": segments, "crossings": crossings,
            "verdict": verdict_text(names, segments, gaps)}


def verdict_text(names: tuple[str, str], segments: list, gaps: list[dict]) -> str:
    if any(math.isnan(g["low"]) for g in gaps):
        return "cannot tell: one seed at a rung, and no other rung's seeds to pool, give no interval"
    parts = []
    for s, start, end in segments:
        where = f"at {sci(start)}" if end / start <= MATCHED ** 2 else f"from {sci(start)} to {sci(end)}"
        if s == 0:
            parts.append(f"cannot tell {where}")
        else:
            lower, higher = names if s < 0 else names[::-1]
            parts.append(f"{lower} lower than {higher} {where}")
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
    elif abs(gap) <= abs(errors[0]) + abs(errors[1]):
        reading = (f"cannot tell: the curves' gap, {abs(gap):.3f} nats, is within their held-out errors "
                   f"({abs(errors[0]):.3f} + {abs(errors[1]):.3f} nats)")
    else:
        lower = names[0] if gap < 0 else names[1]
        reading = (f"{lower}'s curve lower by {abs(gap):.3f} nats, more than the held-out errors "
                   f"({abs(errors[0]):.3f} + {abs(errors[1]):.3f} nats)")
    return {"pair": names, "compute": compute, "label": label, "losses": losses, "gap": gap,
            "held_out": errors, "reading": reading}

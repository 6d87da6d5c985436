"""The learning rates of a ladder: each swept rung's best lr (the vertex of a parabola in log lr through the sweep's
lowest loss and its neighbours), the lr that widens a sweep whose best lies at an end, and a power law
lr = c * size^s fitted by least squares in log-log over the swept rungs (size: d_model or parameters), with the
standard error of its slope. A slope given in the ladder file is kept, and only c is fitted."""

import math
from dataclasses import dataclass

from lm.util.errors import UserError


def best_lr(losses: dict[float, float]) -> tuple[float, str]:
    """(best lr, how it was found) from lr -> mean final loss: the vertex of the parabola in log lr through the
    lowest loss and its two neighbours when that lowest is inside the grid (the vertex kept within those
    neighbours); the lowest itself at an edge of the grid, or with fewer than 3 lrs. The largest lr that did not
    diverge, when it is the lowest and a larger one of the grid diverged, is bracketed by that divergence."""
    finite = sorted((lr, loss) for lr, loss in losses.items() if math.isfinite(loss))
    if not finite:
        raise UserError("every run of an lr sweep diverged (no finite loss): lower the lr grid")
    i = min(range(len(finite)), key=lambda j: finite[j][1])
    if len(finite) >= 3 and i == len(finite) - 1 and finite[i][0] < max(losses):
        return finite[i][0], "below a diverged lr"
    if len(finite) < 3 or i in (0, len(finite) - 1):
        return finite[i][0], "grid edge" if len(finite) >= 3 else "grid minimum"
    (x0, y0), (x1, y1), (x2, y2) = [(math.log(lr), loss) for lr, loss in finite[i - 1:i + 2]]
    # The vertex of the parabola through three points (x need not be evenly spaced).
    numerator = (x1 - x0) ** 2 * (y1 - y2) - (x1 - x2) ** 2 * (y1 - y0)
    denominator = (x1 - x0) * (y1 - y2) - (x1 - x2) * (y1 - y0)
    vertex = x1 - 0.5 * numerator / denominator if denominator else x1
    return math.exp(min(max(vertex, x0), x2)), "parabola vertex"


def rounded(lr: float) -> float:
    """An lr as the ladder names runs by it: 3 significant figures."""
    return float(f"{lr:.3g}")


def widening(losses: dict[float, float], first: list[float], widen: int) -> float | None:
    """The next lr of a sweep (`losses`: lr -> final loss, inf where it diverged) whose lowest loss lies at an end of
    the lrs tried: beyond that end by the ratio of the two lrs there; None when the lowest lies between two others
    (or just below an lr that diverged), or when `widen` lrs already lie beyond the end of the `first` lrs on that
    side."""
    finite = {lr: loss for lr, loss in losses.items() if math.isfinite(loss)}
    if not finite:
        return None
    lrs = sorted(losses)
    best = min(finite, key=finite.get)
    if best == lrs[0] and len(lrs) >= 2 and sum(lr < min(first) for lr in lrs) < widen:
        return rounded(lrs[0] * lrs[0] / lrs[1])
    if best == lrs[-1] and len(lrs) >= 2 and sum(lr > max(first) for lr in lrs) < widen:
        return rounded(lrs[-1] * lrs[-1] / lrs[-2])
    return None


@dataclass(frozen=True)
class LrRule:
    against: str  # "width" (d_model) or "params"
    slope: float  # s in lr = c * size^s
    log_c: float
    fitted_slope: bool
    points: tuple[tuple[float, float], ...]  # (size, best lr) of the swept rungs
    slope_se: float | None = None  # the fitted slope's standard error (3 points or more)

    def lr(self, size: float) -> float:
        return math.exp(self.log_c + self.slope * math.log(size))

    def describe(self) -> str:
        how = "fitted" if self.fitted_slope else "fixed in the ladder file"
        if self.slope_se is not None:
            how += f", standard error {self.slope_se:.3f}"
        size = "d_model" if self.against == "width" else "params"
        return (f"lr = {math.exp(self.log_c):.4g} x {size}^{self.slope:+.3f} (slope {how}; from {len(self.points)} "
                f"swept rung(s))")


def fit_rule(points: list[tuple[float, float]], against: str, slope: float | None) -> LrRule:
    """The rule through (size, best lr) points: least squares in log-log; a given slope leaves the intercept alone
    to fit. A fitted slope needs two distinct sizes."""
    logs = [(math.log(size), math.log(lr)) for size, lr in points]
    sizes = {x for x, _ in logs}
    if slope is None:
        if len(sizes) < 2:
            raise UserError(f"the lr rule's slope against {against} needs swept rungs of two sizes; sweep more rungs "
                            f"or fix lr.slope in the ladder file")
        mean_x = sum(x for x, _ in logs) / len(logs)
        mean_y = sum(y for _, y in logs) / len(logs)
        spread = sum((x - mean_x) ** 2 for x, _ in logs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in logs) / spread
        fitted = True
    else:
        fitted = False
    log_c = sum(y - slope * x for x, y in logs) / len(logs)
    se = None
    if fitted and len(logs) >= 3:
        residual = sum((y - log_c - slope * x) ** 2 for x, y in logs)
        se = math.sqrt(residual / (len(logs) - 2) / spread)
    return LrRule(against, slope, log_c, fitted, tuple(points), se)

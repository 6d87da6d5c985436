"""The learning rate of a ladder's larger rungs, carried up from an lr sweep on its smallest: each swept rung's best
lr (the vertex of a parabola in log lr through the grid's lowest mean loss and its neighbours), then a power law
lr = c * size^s fitted by least squares in log-log over the swept rungs (size: d_model or parameters). With one swept
size, or a slope given in the ladder file, the slope is fixed and only c is fitted."""

import math
from dataclasses import dataclass

from lm.errors import UserError


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


@dataclass(frozen=True)
class LrRule:
    against: str  # "width" (d_model) or "params"
    slope: float  # s in lr = c * size^s
    log_c: float
    fitted_slope: bool
    points: tuple[tuple[float, float], ...]  # (size, best lr) of the swept rungs

    def lr(self, size: float) -> float:
        return math.exp(self.log_c + self.slope * math.log(size))

    def describe(self) -> str:
        how = "fitted" if self.fitted_slope else "fixed in the ladder file"
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
        slope = sum((x - mean_x) * (y - mean_y) for x, y in logs) / sum((x - mean_x) ** 2 for x, _ in logs)
        fitted = True
    else:
        fitted = False
    log_c = sum(y - slope * x for x, y in logs) / len(logs)
    return LrRule(against, slope, log_c, fitted, tuple(points))

"""`lm research ladder-reread FITS_JSON`: the runs of an earlier ladder report read by today's instrument, without
training: each pair's verdict at measured compute (lm.compare.ladder_verdicts) and each architecture's held-out error
at its largest rung by three fits: as the report gave it, by a Huber loss (delta 1e-3) on every run's log loss with
E >= 0 as a bound (the objective of lm before Dec 7, converged), and by today's fit of rung means weighted by their
seeds' pooled variance (lm.compare.scaling_fit). docs/ladder/dec6.md and docs/ladder.md ("Fits") cite what it prints."""

import json
import math
from pathlib import Path

import numpy as np

from lm.util.errors import UserError

HUBER_DELTA = 1e-3  # the Dec 6 fit's, on log loss


def huber_on_runs(computes: np.ndarray, losses: np.ndarray):
    """L(C) = E + A C^-alpha by a Huber loss on every run's log loss, E >= 0, from several starts; the law's L(C)."""
    from scipy.optimize import least_squares

    x, y = np.log(computes), np.log(losses)
    centre = x.mean()
    best = None
    for floor in (1e-3, 0.5, 0.9):
        for alpha in (0.1, 0.3, 0.6):
            e = floor * losses.min()
            start = [e, float(np.mean(np.log(losses - e) + alpha * (x - centre))), alpha]
            found = least_squares(lambda t: np.log(t[0] + np.exp(t[1] - t[2] * (x - centre))) - y, start,
                                  bounds=([0, -np.inf, 0], np.inf), loss="huber", f_scale=HUBER_DELTA, xtol=1e-12,
                                  ftol=1e-12, gtol=1e-12, max_nfev=5000)
            if best is None or found.cost < best.cost:
                best = found
    e, a, alpha = best.x
    return lambda c: e + np.exp(a - alpha * (np.log(c) - centre))


def ladder_reread(fits: str, level: float = 0.9) -> dict:
    """Print the verdicts and held-out errors of an earlier report's runs by today's instrument.

    Args:
        fits: A ladder report's fits.json (its "fitted" runs: compute, loss, rung of each).
        level: Of the intervals.
    """
    from lm.compare.ladder_verdicts import compare, rung_means
    from lm.compare.scaling_fit import held_out

    path = Path(fits)
    if not path.is_file():
        raise UserError(f"{fits} not found")
    try:
        fitted = json.loads(path.read_text())["fitted"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{fits} is no ladder report's fits.json (no \"fitted\" runs)") from None
    means = {arch: rung_means(rows) for arch, rows in fitted.items()}
    archs, verdicts, errors = list(fitted), {}, {}
    for i, first in enumerate(archs):
        for second in archs[i + 1:]:
            verdicts[f"{first} / {second}"] = compare((first, second), means[first], means[second], level)["verdict"]
            print(f"{first} / {second}: {verdicts[f'{first} / {second}']}")
    reported = json.loads(path.read_text()).get("fits", {})
    for arch, rows in fitted.items():
        rows = [r for r in rows if r["loss"] is not None and math.isfinite(r["loss"])]
        groups = np.array([r["rung"] for r in rows])
        if len(set(groups.tolist())) < 4:
            continue
        c, loss = np.array([r["compute"] for r in rows]), np.array([r["loss"] for r in rows])
        top = max(set(groups.tolist()), key=lambda g: c[groups == g].mean())
        law = huber_on_runs(c[groups != top], loss[groups != top])
        errors[arch] = {"reported": (reported.get(arch, {}).get("held_out") or {}).get("largest"),
                        "huber_on_runs": float(np.mean(law(c[groups == top]) - loss[groups == top])),
                        "rung_means": held_out(c, loss, groups)["largest"]}
        shown = {k: "n/a" if v is None else f"{v:+.3f}" for k, v in errors[arch].items()}
        print(f"{arch}: held-out error at the largest rung ({top}): as reported {shown['reported']}, Huber on runs "
              f"with E >= 0 {shown['huber_on_runs']}, rung means weighted {shown['rung_means']}")
    return {"verdicts": verdicts, "held_out": errors}

"""The report of a finished `lm compare ladder` (what it may claim: lm/compare/ladder_verdicts.py):
- verdicts at measured compute: each pair's gap where both have runs, with its seed interval, in segments;
- fits judged by prediction: L(C) = E + A C^-alpha per architecture (lm/compare/scaling_fit.py) with intervals that
  hold the law's misfit (the "misfit" bootstrap), the error of predicting its largest rung from the others and of
  leaving each rung out, and E or alpha reported as "not identified" where the data cannot pin them;
- beyond the runs, the fitted curves read only as labelled extrapolations with those held-out errors;
- per rung the seeds' mean and spread and the lrs tried; the lr rule over all rungs with its slope; the data read;
- iso-FLOP ladders: each budget's compute-optimal size and loss (a parabola in log N) with intervals, compared across
  architectures at each budget, and L(N, D);
- what each run ran on (its record: code, torch, device, threads, resumes), the data order and the validation read;
- a log-log plot (with bands only where the file sets target_compute), and `lm compare report` of the runs with the
  fits as its section.

Files under OUT/report: ladder.md, fits.json, ladder.png (isoflop.png), section.json, compare/ (lm compare report)."""

import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from lm.compare.plan import count, sci
from lm.util.output import markdown_table, strict_json, write_json
from lm.util.plotting import pyplot, save
from lm.util.report_section import write_section

SEED = 0  # of the bootstrap


def points(runs, loss_of, compute_of=None) -> dict[str, list[dict]]:
    """Per architecture, each run of stage 2: its compute (`compute_of(run)`: the FLOPs it spent, or None; else as
    planned), params, tokens and final loss (inf: diverged)."""
    found = defaultdict(list)
    for run in runs:
        loss = loss_of(run)
        spent = compute_of(run) if compute_of else None
        found[run.rung.arch].append({"run": run.name, "rung": run.rung.label, "target": run.rung.target,
                                     "budget": run.rung.budget, "seed": run.seed, "lr": run.lr,
                                     "params": run.rung.params, "tokens": run.rung.tokens,
                                     "compute": spent or run.rung.flops_per_token * run.rung.tokens, "loss": loss})
    return found


def spent_compute(run_dir: Path) -> float | None:
    """The training FLOPs a finished run logged as spent (train/flops; lm/compare/run_results.py), or None."""
    from lm.compare.run_results import read_run

    if not (run_dir / "config.yaml").is_file():
        return None
    results = read_run(str(run_dir))
    return results.flops if results.spent is not None and results.steps else None


def parabola_vertices(log_n: np.ndarray, means: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(log N at the vertex, the loss there, whether it is a minimum) of parabolas fitted to means (R, K) at log_n."""
    design = np.stack([log_n ** 2, log_n, np.ones_like(log_n)], axis=1)
    a, b, c = np.linalg.lstsq(design, means.T, rcond=None)[0]
    minimum = a > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        vertex = np.where(minimum, -b / (2 * a), np.nan)
    return vertex, np.where(minimum, c - b * b / (4 * np.where(minimum, a, 1)), np.nan), minimum


def optimum(at: list[dict], level: float, reps: int, seed: int) -> dict:
    """One budget's parabola of mean loss against log params over its sizes: the compute-optimal size and loss at its
    vertex, with intervals from replicates that resample each size's seeds and add each size's mean residual with a
    random sign (inflated by sqrt(K / (K - 3)) for K sizes), as the "misfit" bootstrap of L(C) does. The optimum is
    not identified where the vertex is no minimum or lies outside the sizes tried."""
    from lm.compare.scaling_fit import interval

    sizes = sorted({r["params"] for r in at})
    log_n = np.log(np.array(sizes, dtype=float))
    seeds = [np.array([r["loss"] for r in at if r["params"] == n]) for n in sizes]
    means = np.array([x.mean() for x in seeds])
    vertex, loss, minimum = (v[0] for v in parabola_vertices(log_n, means[None]))
    design = np.stack([log_n ** 2, log_n, np.ones_like(log_n)], axis=1)
    fitted = design @ np.linalg.lstsq(design, means, rcond=None)[0]
    rng = np.random.default_rng(seed)
    inflation = math.sqrt(len(sizes) / max(len(sizes) - 3, 1))
    signs = rng.choice([-1.0, 1.0], size=(reps, len(sizes)))
    replicates = np.empty((reps, len(sizes)))
    for k, x in enumerate(seeds):
        deviation = (x - x.mean()) * (math.sqrt(len(x) / (len(x) - 1)) if len(x) > 1 else 0.0)
        drawn = deviation[rng.integers(len(x), size=(reps, len(x)))].mean(axis=1)
        replicates[:, k] = fitted[k] + signs[:, k] * (means[k] - fitted[k]) * inflation + drawn
    vertices, losses, _ = parabola_vertices(log_n, replicates)
    inside = bool(minimum and log_n[0] <= vertex <= log_n[-1])
    seeded = any(len(x) > 1 for x in seeds)  # one seed a size: the replicates vary nothing, so no interval
    return {"sizes": sizes, "means": means.tolist(), "coefficients": np.polyfit(log_n, means, 2).tolist(),
            "params_opt": math.exp(vertex) if minimum else None, "loss_opt": float(loss) if minimum else None,
            "identified": inside, "seeded": seeded,
            "params_interval": tuple(math.exp(v) for v in interval(vertices, level)) if seeded else None,
            "loss_interval": interval(losses, level) if seeded else None, "loss_samples": losses}


def isoflop(rows: list[dict], level: float = 0.9, reps: int = 1000, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Per budget: its parabola and compute-optimal size and loss with intervals (optimum; budgets of 3 sizes or
    more), and the runs of the size with the lowest mean loss, which the L(C) fit takes."""
    parabolas, best = [], []
    for budget in sorted({r["budget"] for r in rows}):
        at = [r for r in rows if r["budget"] == budget and math.isfinite(r["loss"])]
        sizes = sorted({r["params"] for r in at})
        means = [float(np.mean([r["loss"] for r in at if r["params"] == n])) for n in sizes]
        if len(sizes) >= 3:
            parabolas.append({"budget": budget, **optimum(at, level, reps, seed)})
        lowest = sizes[int(np.argmin(means))]
        best += [r for r in at if r["params"] == lowest]
    return parabolas, best


def optimum_rows(parabolas: dict, level: float) -> tuple[list[list[str]], list[list[str]]]:
    """The compute-optimal size and loss of each architecture at each budget, and at each budget each pair compared
    at its own best sizes: the gap of the optimal losses (nats) with its interval over the replicates."""
    from lm.compare.scaling_fit import interval

    table, verdicts = [], []
    for arch, items in parabolas.items():
        for p in items:
            if not p["identified"]:
                where, loss = "not identified (outside the sizes tried)", ""
            elif not p["seeded"]:
                where, loss = "one seed: no interval", f"{p['loss_opt']:.4f} (one seed)"
            else:
                where = f"{count(p['params_interval'][0])} to {count(p['params_interval'][1])}"
                loss = interval_text(p["loss_opt"], p["loss_interval"], ".4f")
            table.append([arch, sci(p["budget"]), count(p["params_opt"]) if p["params_opt"] else "no minimum", where,
                          loss])
    archs = list(parabolas)
    for budget in sorted({p["budget"] for items in parabolas.values() for p in items}):
        at = {a: next((p for p in parabolas[a] if p["budget"] == budget), None) for a in archs}
        for i, first in enumerate(archs):
            for second in archs[i + 1:]:
                p1, p2 = at[first], at[second]
                if p1 is None or p2 is None:
                    continue
                if not (p1["identified"] and p2["identified"]):
                    lacking = [a for a, p in ((first, p1), (second, p2)) if not p["identified"]]
                    verdicts.append([f"{first} / {second}", sci(budget), "", f"cannot tell: {', '.join(lacking)}'s "
                                     f"optimum is not identified (outside the sizes tried)"])
                    continue
                gap = p1["loss_opt"] - p2["loss_opt"]
                if not (p1["seeded"] and p2["seeded"]):
                    verdicts.append([f"{first} / {second}", sci(budget), f"{gap:+.4f}", "one seed: no interval"])
                    continue
                lo, hi = interval(np.asarray(p1["loss_samples"]) - np.asarray(p2["loss_samples"]), level)
                lower = first if gap < 0 else second
                sure = (hi < 0 and gap < 0) or (lo > 0 and gap > 0)
                verdicts.append([f"{first} / {second}", sci(budget), f"{gap:+.4f} [{lo:+.4f}, {hi:+.4f}]",
                                 f"{lower} lower, each at its own best size" if sure else "cannot tell"])
    return table, verdicts


def interval_text(value: float, bounds: tuple[float, float], form: str = ".3g") -> str:
    return f"{value:{form}} [{bounds[0]:{form}}, {bounds[1]:{form}}]"


E_FLOOR = 0.01  # E below 1% of the lowest loss counts as at its bound 0
ALPHA_SPAN = 10.0  # an alpha interval wider than this factor does not pin alpha


def power_law_allowed(x: np.ndarray, y: np.ndarray, weights: np.ndarray, residual: np.ndarray, level: float) -> bool:
    """Whether the rung means allow E = 0: a pure power law (a line in log-log, weighted least squares) fits them as
    well as the free law, by an F test at `level`: F = (the line's weighted squared residuals - the free fit's) /
    (the free fit's / (K - 3)) against the F(1, K - 3) quantile at `level` (K rungs; with K = 3, always allowed)."""
    from scipy.stats import f

    dof = len(y) - 3
    if dof < 1:
        return True
    slope, intercept = np.polyfit(x, y, 1, w=weights)
    line = float(np.sum((weights * (y - intercept - slope * x)) ** 2))
    free = float(np.sum((weights * residual) ** 2))
    if free == 0:  # the free law is exact: E = 0 is allowed only if the line is too (to rounding)
        return line <= 1e-20 * float(np.sum((weights * y) ** 2))
    return bool((line - free) / (free / dof) <= f.ppf(level, 1, dof))


def identified(fit: dict, level: float) -> None:
    """Mark E and alpha "not identified" where the data cannot pin them: E where a pure power law (E = 0) fits the runs
    as well (power_law_allowed), or its interval (or the point) reaches below E_FLOOR of the lowest loss, i.e. its
    bound 0; alpha where its interval is not positive or spans more than ALPHA_SPAN."""
    floor = E_FLOOR * fit["lowest_loss"]
    fit["E_identified"] = bool(not fit["power_law_allowed"] and fit["E"] >= floor and fit["E_interval"][0] >= floor)
    lo, hi = fit["alpha_interval"]
    fit["alpha_identified"] = bool(lo > 0 and hi <= ALPHA_SPAN * lo)
    for name in ("E", "alpha"):
        lo, hi = fit[f"{name}_interval"]
        fit[f"{name}_outside"] = not lo - 1e-9 <= fit[name] <= hi + 1e-9  # the point outside its own interval


def fit_arch(rows: list[dict], spec, target: float | None, seed: int) -> dict:
    """L(C) of one architecture with "misfit" bootstrap intervals (replicates drawn from `seed`), its held-out errors
    (nats) and its prediction at `target`; where too few rungs finished, why no fit."""
    finite = [r for r in rows if math.isfinite(r["loss"])]
    computes = np.array([r["compute"] for r in finite])
    losses = np.array([r["loss"] for r in finite])
    groups = [r["rung"] for r in finite]
    if len(set(groups)) < 4:
        return {"runs": len(finite), "why": f"{len(set(groups))} rung(s) with finished runs: a law of 3 parameters, "
                                            "judged on a rung it did not see, needs 4"}
    with np.errstate(over="ignore"):  # a replicate's A C^-alpha may overflow where E is not identified
        return fitted_arch(computes, losses, groups, spec, target, seed)


def fitted_arch(computes: np.ndarray, losses: np.ndarray, groups: list[str], spec, target: float | None,
                seed: int) -> dict:
    """fit_arch's fit of the rung means of the finished runs (computes, losses, their rungs)."""
    from lm.compare.scaling_fit import bootstrap_laws, fit_law, held_out, interval, predict_thetas, rungs_of

    law = fit_law(computes, losses, groups=groups)
    thetas, replicates_converged = bootstrap_laws(computes, losses, groups, reps=spec.bootstrap, seed=seed)
    rungs = rungs_of(computes, losses, groups)
    x, y = np.log(rungs.values[:, 0]), rungs.log_means
    weights = np.ones_like(y) if rungs.errors is None else 1 / rungs.errors
    residual = y - np.log(law.predict(rungs.values[:, 0]))
    fit = {"runs": len(losses), "rungs": len(set(groups)), "theta": law.theta.tolist(), "thetas": thetas,
           "converged": law.converged, "replicates_converged": replicates_converged,
           "weighted": rungs.errors is not None,
           "E": law.E, "E_interval": interval(thetas[:, 0], spec.level),
           "E_at_bound": float(np.mean(thetas[:, 0] < E_FLOOR * losses.min())),
           "alpha": law.exponents[0], "alpha_interval": interval(thetas[:, 2], spec.level),
           "A": law.coefficients[0], "largest_compute": float(computes.max()),
           "lowest_loss": float(losses.min()), "rms_log_residual": float(np.sqrt(np.mean(residual ** 2))),
           "held_out": held_out(computes, losses, groups),
           "power_law_allowed": power_law_allowed(x, y, weights, residual, spec.level)}
    if target is not None:
        fit["target_loss"] = float(law.predict(np.array([target]))[0])
        fit["target_interval"] = interval(predict_thetas(thetas, np.array([target]))[:, 0], spec.level)
    identified(fit, spec.level)
    return fit


def estimate_text(fit: dict, name: str) -> str:
    if not fit[f"{name}_identified"]:
        return (f"not identified ({fit[name]:.3g}{', at its bound' if fit[name] == 0 else ''}; the data allow E = 0)"
                if name == "E" else
                f"not identified ({fit[name]:.3g}; interval {fit[f'{name}_interval'][0]:.3g} to "
                f"{fit[f'{name}_interval'][1]:.3g})")
    return interval_text(fit[name], fit[f"{name}_interval"]) + (" (the point lies outside its interval)"
                                                                 if fit[f"{name}_outside"] else "")


def nats(value: float | None) -> str:
    return "" if value is None else f"{value:+.3f}"


def converged_text(fit: dict) -> str:
    if not fit["converged"]:
        return "no: the fit stopped at its evaluation cap"
    share = fit["replicates_converged"]
    return "yes" + ("" if share == 1 else f" ({share:.1%} of the replicates)")


def fit_rows(fits: dict, target: float | None) -> list[list[str]]:
    """The fits table: estimates, whether the fit converged, held-out errors (nats), and with a target the reading
    there, labelled."""
    from lm.compare.ladder_verdicts import times

    table = []
    for arch, fit in fits.items():
        if "theta" not in fit:
            table.append([arch, str(fit["runs"]), fit["why"]] + [""] * (6 + (target is not None)))
            continue
        ho = fit["held_out"]
        row = [arch, str(fit["runs"]), str(fit["rungs"]), estimate_text(fit, "alpha"), estimate_text(fit, "E"),
               converged_text(fit), nats(ho["largest"]) or "too few rungs", nats(ho["rms"]).lstrip("+"),
               f"{fit['rms_log_residual']:.4f}"]
        if target is not None:
            past = target / fit["largest_compute"]
            where = f"extrapolated, {times(past)} past the largest run" if past > 1 + 1e-9 else "inside the runs"
            row.append(interval_text(fit["target_loss"], fit["target_interval"], ".4g") + f"; {where}")
        table.append(row)
    return table


def plot(fits: dict, found: dict, low: float, high: float, target: float | None, path: Path, level: float) -> None:
    """The runs and each fitted curve; with a target, the curves run to it with their bootstrap bands; without one,
    the point fit alone over the measured range."""
    from lm.compare.scaling_fit import predict_thetas

    plt = pyplot()
    from matplotlib.ticker import FormatStrFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = np.geomspace(low / 2, target, 200) if target else np.geomspace(low, high, 200)
    losses = [r["loss"] for rows in found.values() for r in rows if math.isfinite(r["loss"])]
    for i, (arch, rows) in enumerate(found.items()):
        colour = f"C{i}"
        finite = [r for r in rows if math.isfinite(r["loss"])]
        ax.scatter([r["compute"] for r in finite], [r["loss"] for r in finite], color=colour, s=14, label=arch)
        fit = fits.get(arch, {})
        if "theta" in fit:
            with np.errstate(over="ignore", invalid="ignore"):  # a degenerate replicate's A C^-alpha overflows
                curves = predict_thetas(fit["thetas"], grid)
                curve = predict_thetas(np.array([fit["theta"]]), grid)[0]
            ax.plot(grid, np.where(np.isfinite(curve), curve, np.nan), color=colour, lw=1.2)
            if target:
                curves[~np.isfinite(curves)] = np.nan
                lo, hi = np.nanquantile(curves, [(1 - level) / 2, (1 + level) / 2], axis=0)
                ax.fill_between(grid, lo, hi, color=colour, alpha=0.2, lw=0)
                losses.append(float(np.nanmin(lo)))
    if target:
        ax.axvline(target, color="grey", ls=":", lw=1)
    ax.set_ylim(min(losses) * 0.95, max(losses) * 1.05)  # the points and the bands' floor, not an overflow
    fitted = any("theta" in fit for fit in fits.values())
    title = ("each run's final loss (no fit: a law needs 4 rungs)" if not fitted else
             f"L(C) = E + A C^-alpha, {level:.0%} bands to the target" if target else
             "L(C) = E + A C^-alpha over the runs (no target: no bands)")
    ax.set(xscale="log", yscale="log", xlabel="training compute (FLOPs)", ylabel="final validation loss", title=title)
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # 1.8, not 1.8 x 10^0
        axis(FormatStrFormatter("%.2f"))
    ax.legend(fontsize=8)
    save(fig, path)


def plot_isoflop(parabolas: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (arch, items) in enumerate(parabolas.items()):
        for j, p in enumerate(items):
            xs = np.geomspace(min(p["sizes"]) / 1.2, max(p["sizes"]) * 1.2, 100)
            ax.scatter(p["sizes"], p["means"], color=f"C{i}", s=12, label=arch if j == 0 else None)
            ax.plot(xs, np.polyval(p["coefficients"], np.log(xs)), color=f"C{i}", lw=1, alpha=0.8)
    ax.set(xscale="log", xlabel="parameters", ylabel="final validation loss (mean over seeds)",
           title="Iso-FLOP: loss against size at each budget")
    ax.legend(fontsize=8)
    save(fig, path)


def nd_fit(rows: list[dict], spec) -> dict | None:
    """L(N, D) = E + A N^-alpha + B D^-beta, where the runs leave one tokens-per-parameter line (iso-FLOP)."""
    from lm.compare.scaling_fit import bootstrap_laws, fit_law, interval

    finite = [r for r in rows if math.isfinite(r["loss"])]
    ratios = {round(r["tokens"] / r["params"], 6) for r in finite}
    if len(ratios) < 2 or len(finite) < 6:
        return None
    values = np.array([[r["params"], r["tokens"]] for r in finite], dtype=float)
    losses = np.array([r["loss"] for r in finite])
    law = fit_law(values, losses, variables=("N", "D"))
    thetas, _ = bootstrap_laws(values, losses, reps=spec.bootstrap, seed=SEED, variables=("N", "D"))
    return {"E": law.E, "alpha": law.exponents[0], "beta": law.exponents[1], "converged": law.converged,
            "alpha_interval": interval(thetas[:, 2], spec.level), "beta_interval": interval(thetas[:, 4], spec.level),
            "E_interval": interval(thetas[:, 0], spec.level)}


def rule_record(rule: dict) -> dict:
    """An architecture's lr sweeps and rule as JSON (lr keys as strings)."""
    return {"rule": rule["rule"].describe() if rule["rule"] else None,
            "sweeps": [{**s, "losses": {str(lr): loss for lr, loss in s["losses"].items()}} for s in rule["sweeps"]]}


def verdict_rows(fitted: dict, fits: dict, level: float, target: float | None) -> dict:
    """Every pair: its verdict at measured compute, its gaps at the rungs' computes, and (with a target) its fitted
    curves read at the target where that lies beyond the range both were measured over."""
    from lm.compare.ladder_verdicts import MATCHED, compare, extrapolated, rung_means

    means = {arch: rung_means(rows) for arch, rows in fitted.items()}
    archs = [a for a in fitted if means[a]]
    measured, gaps, beyond, records = [], [], [], []
    for i, first in enumerate(archs):
        for second in archs[i + 1:]:
            pair = (first, second)
            found = compare(pair, means[first], means[second], level)
            span = found["range"]
            crossing = ("; ".join(f"at {sci(c)} (point estimates)" for c in found["crossings"])
                        or "none inside the measured range") if span else ""
            where = "none" if not span else f"{sci(math.sqrt(span[0] * span[1]))} (matched within 2%)" \
                if span[1] / span[0] <= MATCHED ** 2 else f"{sci(span[0])} to {sci(span[1])}"
            measured.append([f"{first} / {second}", where, found["verdict"], crossing])
            gaps += [[f"{first} / {second}", sci(g["compute"]), f"{g['gap']:+.4f}",
                      f"[{g['low']:+.4f}, {g['high']:+.4f}]" if math.isfinite(g["low"]) else "no interval (one seed)"]
                     for g in found["gaps"]]
            far = None if target is None else extrapolated(
                pair, (fits[first], fits[second]), target, span, (means[first][-1].compute, means[second][-1].compute))
            if far is not None:
                beyond.append([f"{first} / {second}", sci(far["compute"]), far.get("label", ""), far["reading"]])
            records.append({**{k: v for k, v in found.items() if k != "segments"},
                            "segments": [list(s) for s in found["segments"]], "beyond": far})
    return {"measured": measured, "gaps": gaps, "beyond": beyond, "records": records}


def rung_rows(found: dict, rules: dict, level: float) -> list[list[str]]:
    """Per architecture and rung (iso-FLOP: size and budget): compute, the seeds' mean (with its t interval) and
    spread, the lrs tried at the sweep's seed and the best."""
    from lm.compare.ladder_verdicts import rung_means, t_quantile

    sweeps = {(arch, s["rung"]): s for arch, r in rules.items() for s in r["sweeps"]}
    sizes = {(arch, s["target"]): s for arch, r in rules.items() for s in r["sweeps"]}  # iso-FLOP: a size's sweep
    table = []
    for arch, rows in found.items():
        for m in rung_means(rows):
            at = [r for r in rows if r["rung"] == m.rung]
            losses = [r["loss"] for r in at if math.isfinite(r["loss"])]
            sweep, lr = sweeps.get((arch, m.rung)), at[0]["lr"]
            if sweep:
                tried = ", ".join(f"{x:g}: {loss:.4f}" for x, loss in sweep["losses"].items())
                best = f"{sweep['best_lr']:.3g} ({sweep['found_by']})"
            elif (arch, at[0]["target"]) in sizes:
                tried, best = "", f"{lr:g} (its size's sweep, at {sizes[arch, at[0]['target']]['rung']})"
            else:
                tried, best = "", f"{lr:g} (the rule)"
            half = t_quantile((1 + level) / 2, m.n - 1) * math.sqrt(m.var / m.n) if m.var is not None else None
            table.append([arch, m.rung, sci(m.compute), str(m.n), f"{m.mean:.4f}" + (
                f" [{m.mean - half:.4f}, {m.mean + half:.4f}]" if half is not None else ""),
                f"{max(losses) - min(losses):.4f}", tried, best])
    return table


def data_lines(spec, corpus, found: dict, run_configs: list[dict]) -> list[str]:
    """The corpus and the most epochs a run read, the data order, and how much validation each run read."""
    from lm.compare.ladder_plan import data_order

    lines = [f"Data: {corpus.where if corpus else 'not known'}."]
    if corpus is not None and corpus.tokens:
        most = max((r for rows in found.values() for r in rows), key=lambda r: r["tokens"])
        lines = [f"Data: {corpus.where}, {count(corpus.tokens)} training tokens. The longest run reads "
                 f"{count(most['tokens'])} tokens ({most['run']}): {most['tokens'] / corpus.tokens:.3g} epochs."]
    lines.append(f"Data order: {data_order(spec)}.")
    read = sorted({validation_read(config) for config in run_configs})
    lines.append("Validation: " + "; ".join(read) + ".")
    return lines


def validation_read(config: dict) -> str:
    """What a run's final validation read: the whole validation split, or a sample of a stated size."""
    from lm.data_prep.shards import load_manifest
    from lm.training.data import count_windows

    data = config.get("data") or {}
    seq_len, windows = data.get("seq_len"), data.get("val_windows", 256)
    try:
        tokens = int(load_manifest(data["path"], verify=False)["splits"]["validation"]["tokens"])
    except (KeyError, OSError, ValueError, TypeError):
        tokens = None
    total = count_windows(tokens, seq_len) if tokens is not None and seq_len else None
    whole = f"of {total:,} windows of {seq_len} tokens" if total is not None else "of a split of unknown size"
    if windows is None or (total is not None and windows >= total):
        return f"the whole validation split ({whole})"
    return f"a sample of {windows:,} windows ({windows * seq_len:,} tokens) {whole}"


def choice_lines(chosen: dict | None) -> list[str]:
    if not chosen:
        return []
    pct = f"{chosen['level']:.0%}"
    reference = next(r for r in chosen["rows"] if r["value"] == chosen["reference"])

    def against(row: dict) -> str:
        if row is reference:
            return "(the reference)"
        if row["interval"] is None:
            return "no interval (a run diverged)"
        return f"{row['mean'] - reference['mean']:+.4f} [{row['interval'][0]:+.4f}, {row['interval'][1]:+.4f}]"

    rows = [[f"{chosen['option']} {r['value']}", r["rung"], ", ".join(f"{x:.4f}" for x in r["losses"]),
             f"{r['mean']:.4f}", f"{r['spread']:.4f}", against(r), "yes" if r["within"] else "no"]
            for r in chosen["rows"]]
    rung = f"{chosen['rung'] / 1e3:.3g}k"
    confirmed = (f"It was made at the {rung} rung, the largest that uses it." if chosen["confirmed"] else
                 f"It was made at the {rung} rung and not confirmed at the largest rung that uses it "
                 f"({chosen['largest_rung'] / 1e3:.3g}k): it rests on the smaller rung's runs.")
    tolerance = f"{chosen['tolerance']:g}"
    return ["## The choice", "", f"{chosen['arch']} trained with each {chosen['option']} at lr {chosen['lr']:g}: the "
            f"smallest shown to be at most {tolerance} nats above {chosen['option']} {chosen['reference']} (the upper "
            f"end of the {pct} Welch interval of its mean loss minus the reference's lies below {tolerance}) is "
            f"chosen: **{chosen['option']} {chosen['chosen']}**. {confirmed}", "",
            markdown_table([chosen["option"], "rung", "final loss by seed", "mean", "spread",
                            f"minus the reference [{pct}]", "within"], rows)]


def write_report(spec, rules: dict, runs: list, out: Path, loss_of, dir_of, seq_len: int, chosen: dict | None = None,
                 corpus=None) -> Path:
    """The verdicts, fits, tables and plots into OUT/report, and `lm compare report` of the runs (`dir_of(run)`: its
    run directory; `loss_of(run)`: its final loss) with them as its section. Refused in one line where the runs'
    records name different code (unless the ladder file allows it)."""
    import yaml

    from lm.compare.ladder_records import check_code, describe, summary
    from lm.compare.report import report
    from lm.training.run_record import read_record

    check_code([dir_of(run) for run in runs], spec.allow_mixed_code, str(spec.path), training=False)
    report_dir = out / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    found = points(runs, loss_of, lambda run: spent_compute(dir_of(run)))
    records = {run.name: read_record(dir_of(run)) for run in runs}
    configs = [yaml.safe_load((dir_of(run) / "config.yaml").read_text()) or {} for run in runs
               if (dir_of(run) / "config.yaml").is_file()]
    parabolas, fitted = {}, dict(found)  # iso-FLOP: verdicts and L(C) take each budget's best size
    if spec.budgets:
        for i, (arch, rows) in enumerate(found.items()):
            parabolas[arch], fitted[arch] = isoflop(rows, spec.level, spec.bootstrap, SEED + i)
        parabolas = {a: p for a, p in parabolas.items() if p}
    computes = [r["compute"] for rows in fitted.values() for r in rows]
    low, high = min(computes), max(computes)
    target = spec.target_compute
    # Each architecture's replicates from a seed of its own: the runs of two architectures are independent samples.
    fits = {arch: fit_arch(rows, spec, target, SEED + i) for i, (arch, rows) in enumerate(fitted.items())}
    pct = f"{spec.level:.0%}"
    verdicts = verdict_rows(fitted, fits, spec.level, target)
    header = ["arch", "runs", "rungs", f"alpha [{pct}]", f"E [{pct}]", "converged",
              "held-out error at the largest rung (nats)", "leave-one-rung-out RMS (nats)", "RMS log residual"]
    header += [f"loss at {sci(target)} FLOPs [{pct}]"] if target is not None else []
    table = fit_rows(fits, target)
    images = ["ladder.png"]
    plot(fits, fitted, low, high, target, report_dir / "ladder.png", spec.level)
    if parabolas:
        plot_isoflop(parabolas, report_dir / "isoflop.png")
        images.append("isoflop.png")
    nd = {arch: nd_fit(rows, spec) for arch, rows in found.items()} if spec.budgets else {}
    nd = nd if any(nd.values()) else {}

    lines = [f"# Ladder: {spec.path}", "", "## Verdicts at measured compute", "",
             f"An architecture is read only inside its own runs: at a rung, its seeds' mean; between two rungs, the "
             f"line in log compute between them, with the wider rung's variance and the line's own error (from how "
             f"far each rung lies off the line through its neighbours). The gap is read with its {pct} interval "
             f"(Student's t over the seeds, Welch's degrees of freedom, plus the lines' errors). A verdict names the "
             f"lower one only where that interval excludes 0. Runs within 2% of each other's compute count as "
             f"matched.", "",
             markdown_table(["pair", "both measured (FLOPs)", "verdict", "where the point estimates cross"],
                            verdicts["measured"]),
             "### Gaps at the rungs' computes (first minus second, nats)", "",
             markdown_table(["pair", "compute", "gap", f"{pct} interval"], verdicts["gaps"])]
    if verdicts["beyond"]:
        lines += ["## Beyond the measured range: the fitted curves (extrapolated)", "",
                  "Read only as labelled: how far past the largest run each curve is read, and whether the gap "
                  "exceeds the fits' errors at predicting their own largest rung from the others.", "",
                  markdown_table(["pair", "at (FLOPs)", "extrapolated", "reading"], verdicts["beyond"])]
    lines += ["## Fits judged by prediction", "",
              f"L(C) = E + A C^-alpha per architecture (C: training FLOPs as spent), fitted to its rung means (log "
              f"mean loss, each rung weighted by its standard error from the seeds' variance pooled over the rungs) "
              f"by scipy's least_squares with E >= 0 and a Huber loss; converged: the optimiser stopped on its "
              f"tolerances. [{pct} intervals] from "
              f"{spec.bootstrap} replicates that resample the seeds within each rung and add each rung's residual "
              f"with a random sign (the law's misfit). Held-out errors: the law fitted without a rung, its prediction "
              f"there minus the rung's mean loss; the largest rung's, and the root mean square over every rung left "
              f"out in turn. E or alpha is \"not identified\" where the data cannot pin it (E: a pure power law fits "
              f"as well by an F test, or its interval reaches its bound 0).", "", markdown_table(header, table)]
    if parabolas:
        optima, compared = optimum_rows(parabolas, spec.level)
        lines += ["## Compute-optimal comparison (iso-FLOP parabolas)", "",
                  f"At each budget, the parabola of mean loss against log params; its vertex is the compute-optimal "
                  f"size and loss, [{pct} intervals] from replicates as for L(C).", "",
                  markdown_table(["arch", "budget", "compute-optimal params", f"{pct} interval", "loss at the optimum"],
                                 optima),
                  markdown_table(["pair", "budget", "gap of the optimal losses (nats)", "verdict"], compared)]
    if nd:
        lines += ["## L(N, D) = E + A N^-alpha + B D^-beta (all sizes of every budget)", "",
                  markdown_table(["arch", "alpha", "beta", "E"], [
                      [a, interval_text(f["alpha"], f["alpha_interval"]), interval_text(f["beta"], f["beta_interval"]),
                       interval_text(f["E"], f["E_interval"])] if f else [a, "too few runs", "", ""]
                      for a, f in nd.items()])]
    elif not spec.budgets:
        lines += ["L(N, D) is not fitted: every run trains the same tokens per parameter, so N and D move together "
                  "(set budgets: for iso-FLOP runs).", ""]
    lines += choice_lines(chosen)
    lines += ["## Rungs", "", f"The seeds' mean final loss and spread (max - min) at each rung; the lrs its sweep "
              f"tried at the sweep's seed ({spec.sweep_seed}), and its best lr. The seeds ran at the best lr the sweep "
              f"trained, each a fresh run (the sweep's own runs are not among them).", "",
              markdown_table(["arch", "rung", "compute", "seeds", f"mean loss [{pct} seed interval]", "spread",
                              f"final loss by lr (seed {spec.sweep_seed})", "best lr"],
                             rung_rows(found, rules, spec.level)),
              "## Learning rates", "", "The rule fitted over every swept rung's best lr (each the vertex of a "
              "parabola in log lr), with its slope; it sets the lr of a rung that was not swept.", "",
              markdown_table(["arch", "rule", "rungs whose best lr lies at the sweep's end"], [
                  [arch, r["rule"].describe() if r["rule"] else "none: one swept size",
                   ", ".join(s["rung"] for s in r["sweeps"] if s["found_by"] in ("grid edge", "grid minimum"))
                   or "none"] for arch, r in rules.items()]),
              *data_lines(spec, corpus, found, configs), "",
              "## What the runs ran on", "", "From each run's record (RUN/run_record.json):", "",
              *summary(records), "",
              "## Runs", "", markdown_table(
                  ["arch", "rung", "seed", "lr", "params", "tokens", "compute", "final loss", "code", "torch",
                   "threads", "resumed at step"], [
                  [arch, r["rung"], r["seed"], f"{r['lr']:g}", f"{r['params']:,}", f"{r['tokens']:,}",
                   sci(r["compute"]), f"{r['loss']:.4f}", *(lambda d: [d["code"], d["torch"], d["threads"],
                                                                       d["resumed at"]])(describe(records[r["run"]]))]
                  for arch, rows in found.items() for r in rows])]
    (report_dir / "ladder.md").write_text("\n".join(lines) + "\n")
    write_json(report_dir / "fits.json", strict_json({
        "target_compute": target, "level": spec.level,
        "fits": {a: {k: v for k, v in f.items() if k not in ("thetas", "target_samples")} for a, f in fits.items()},
        "verdicts": verdicts["records"], "nd": nd, "points": found, "fitted": fitted, "choice": chosen,
        "parabolas": {a: [{k: v for k, v in p.items() if k != "loss_samples"} for p in ps]
                      for a, ps in parabolas.items()},
        "lr_rules": {arch: rule_record(r) for arch, r in rules.items()},
        "records": {name: describe(record) for name, record in records.items()}}), indent=1)
    write_section(report_dir, "Scaling ladder: L(C) per architecture", header, table, images)
    report([str(dir_of(run)) for run in runs], out=str(report_dir / "compare"),
           title=f"lm compare ladder: {spec.path.name}", sections=[str(report_dir)],
           positions=[1, max(2, seq_len // 8), seq_len])
    print(f"lm compare ladder: wrote {report_dir / 'ladder.md'} and {report_dir / 'compare' / 'report.html'}",
          file=sys.stderr)
    return report_dir

"""The report of a finished `lm compare ladder`: per architecture the fitted L(C) = E + A C^-alpha with bootstrap
intervals (lm/compare/scaling_fit.py), its prediction at the target compute, the crossovers of each pair, the iso-FLOP
parabolas and L(N, D) where the budgets allow, the lr rule, a log-log plot with bands, and `lm compare report` of the
runs with all this as its section.

Files under OUT/report: ladder.md, fits.json, ladder.png (isoflop.png), section.json, compare/ (lm compare report)."""

import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from lm.compare.plan import count, sci
from lm.output import markdown_table, write_json
from lm.plotting import pyplot, save
from lm.report_section import write_section

DEFAULT_TARGET_FACTOR = 100.0  # without target_compute: predict at 100x the ladder's largest compute
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


def isoflop(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per budget: the parabola of mean loss against log params over its sizes (the compute-optimal size at its
    vertex), and the runs of the size with the lowest mean loss, which the L(C) fit takes."""
    parabolas, best = [], []
    for budget in sorted({r["budget"] for r in rows}):
        at = [r for r in rows if r["budget"] == budget and math.isfinite(r["loss"])]
        sizes = sorted({r["params"] for r in at})
        means = [float(np.mean([r["loss"] for r in at if r["params"] == n])) for n in sizes]
        if len(sizes) >= 3:
            a, b, c = np.polyfit(np.log(sizes), means, 2)
            vertex = -b / (2 * a) if a > 0 else None
            parabolas.append({"budget": budget, "coefficients": [a, b, c], "sizes": sizes, "means": means,
                              "params_opt": math.exp(vertex) if vertex is not None else None,
                              "loss_opt": c - b * b / (4 * a) if a > 0 else None})
        lowest = sizes[int(np.argmin(means))]
        best += [r for r in at if r["params"] == lowest]
    return parabolas, best


def interval_text(value: float, bounds: tuple[float, float], form: str = ".3g") -> str:
    return f"{value:{form}} [{bounds[0]:{form}}, {bounds[1]:{form}}]"


def fit_arch(rows: list[dict], spec, target: float, seed: int) -> dict:
    """L(C) of one architecture with bootstrap intervals (replicates drawn from `seed`) and its prediction at
    `target`; where too few rungs finished, why no fit."""
    from lm.compare.scaling_fit import bootstrap_laws, fit_law, interval, predict_thetas

    finite = [r for r in rows if math.isfinite(r["loss"])]
    computes = np.array([r["compute"] for r in finite])
    losses = np.array([r["loss"] for r in finite])
    if len(set(computes.tolist())) < 3 or len(finite) < 4:
        return {"runs": len(finite), "why": f"{len(set(computes.tolist()))} compute value(s) and {len(finite)} "
                                            "finished runs: a fit of 3 parameters needs 3 values and 4 runs"}
    law = fit_law(computes, losses)
    thetas = bootstrap_laws(computes, losses, groups=[r["rung"] for r in finite], reps=spec.bootstrap, seed=seed)
    at_target = predict_thetas(thetas, np.array([target]))[:, 0]
    residual = np.log(losses) - np.log(law.predict(computes))
    return {"runs": len(finite), "theta": law.theta.tolist(), "thetas": thetas,
            "E": law.E, "E_interval": interval(np.exp(thetas[:, 0]), spec.level),
            "alpha": law.exponents[0], "alpha_interval": interval(thetas[:, 2], spec.level),
            "A": law.coefficients[0], "target_loss": float(law.predict(np.array([target]))[0]),
            "target_interval": interval(at_target, spec.level), "target_samples": at_target,
            "rms_log_residual": float(np.sqrt(np.mean(residual ** 2)))}


def crossover_rows(fits: dict, spec, low: float, target: float) -> list[list[str]]:
    """Each pair of fitted architectures: where their curves cross between the ladder's smallest compute and the
    target, with an interval over the paired replicates, or that they do not, or that the data cannot tell."""
    from lm.compare.scaling_fit import crossover, crossovers, interval

    names = [a for a in fits if "theta" in fits[a]]
    rows = []
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            f1, f2 = fits[first], fits[second]
            point = crossover(np.array(f1["theta"]), np.array(f2["theta"]), math.log(low), math.log(target))
            reps = crossovers(f1["thetas"], f2["thetas"], math.log(low), math.log(target))
            share = float(np.mean(np.isfinite(reps)))
            ahead = float(np.mean(f1["target_samples"] < f2["target_samples"]))
            leader = first if ahead >= 0.5 else second
            sure = max(ahead, 1 - ahead)
            if point is not None and share >= spec.level:
                lo, hi = interval(np.exp(reps), spec.level)  # over the replicates that cross
                verdict = f"cross at {sci(math.exp(point))} FLOPs [{sci(lo)}, {sci(hi)}]"
            elif point is None and share <= 1 - spec.level:
                verdict = f"no crossover up to the target: {leader} lower there in {sure:.0%} of replicates"
            else:
                verdict = "the data cannot tell; " + more_seeds_needed(f1["target_samples"], f2["target_samples"],
                                                                      spec)
            rows.append([f"{first} / {second}", verdict, f"{share:.0%}", f"{leader} ({sure:.0%})"])
    return rows


def more_seeds_needed(samples_1, samples_2, spec) -> str:
    """How many seeds per rung (or rungs at these seeds) would put one architecture lower at the target in `level` of
    the replicates, from the bootstrap: the gap in log loss there has mean m and spread s over the replicates; s
    shrinks as 1 / sqrt(runs) (seeds resampled within rungs), so the level is reached at runs x (z s / m)^2, z the
    normal quantile of `level`. An estimate: more rungs over a wider range also shorten the extrapolation."""
    from statistics import NormalDist

    gap = np.log(np.asarray(samples_1)) - np.log(np.asarray(samples_2))
    gap = gap[np.isfinite(gap)]
    mean, spread = float(np.mean(gap)), float(np.std(gap))
    factor = (NormalDist().inv_cdf(spec.level) * spread / abs(mean)) ** 2 if mean else math.inf
    if factor > 100:
        return "more than 100x the runs would be needed: the two are equal within the seeds' noise"
    if factor <= 1:  # which is lower at the target is settled; where in the range they cross is not
        return ("which is lower at the target is already settled by these runs; where they cross is not, which "
                "rungs over a wider range of compute would settle")
    seeds, rungs = len(spec.seeds), len(spec.rungs)
    return (f"about {math.ceil(seeds * factor)} seeds per rung (or {math.ceil(rungs * factor)} rungs at "
            f"{seeds} seeds) would, from the bootstrap's spread")


def plot(fits: dict, found: dict, low: float, target: float, path: Path, level: float) -> None:
    from lm.compare.scaling_fit import predict_thetas

    plt = pyplot()
    from matplotlib.ticker import FormatStrFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = np.geomspace(low / 2, target, 200)
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
            curves[~np.isfinite(curves)] = np.nan
            lo, hi = np.nanquantile(curves, [(1 - level) / 2, (1 + level) / 2], axis=0)
            ax.plot(grid, np.where(np.isfinite(curve), curve, np.nan), color=colour, lw=1.2)
            ax.fill_between(grid, lo, hi, color=colour, alpha=0.2, lw=0)
            losses.append(float(np.nanmin(lo)))
    ax.axvline(target, color="grey", ls=":", lw=1)
    ax.set_ylim(min(losses) * 0.95, max(losses) * 1.05)  # the points and the bands' floor, not an overflow
    ax.set(xscale="log", yscale="log", xlabel="training compute (FLOPs)", ylabel="final validation loss",
           title=f"Fitted L(C) = E + A C^-alpha, {level:.0%} bootstrap bands")
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
    thetas = bootstrap_laws(values, losses, reps=spec.bootstrap, seed=SEED, variables=("N", "D"))
    return {"E": law.E, "alpha": law.exponents[0], "beta": law.exponents[1],
            "alpha_interval": interval(thetas[:, 2], spec.level), "beta_interval": interval(thetas[:, 4], spec.level),
            "E_interval": interval(np.exp(thetas[:, 0]), spec.level)}


def rule_record(rule: dict) -> dict:
    """An architecture's lr sweeps and rule as JSON (lr keys as strings)."""
    return {"rule": rule["rule"].describe() if rule["rule"] else None,
            "sweeps": [{**s, "losses": {str(lr): loss for lr, loss in s["losses"].items()}} for s in rule["sweeps"]]}


def write_report(spec, rules: dict, runs: list, out: Path, loss_of, dir_of, seq_len: int) -> Path:
    """The fits, tables and plots into OUT/report, and `lm compare report` of the runs (`dir_of(run)`: its run
    directory; `loss_of(run)`: its final loss) with them as its section."""
    from lm.compare.report import report

    report_dir = out / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    found = points(runs, loss_of, lambda run: spent_compute(dir_of(run)))
    parabolas, fitted = {}, dict(found)  # iso-FLOP: L(C) fits each budget's best size
    if spec.budgets:
        for arch, rows in found.items():
            parabolas[arch], fitted[arch] = isoflop(rows)
    computes = [r["compute"] for rows in fitted.values() for r in rows]
    low, high = min(computes), max(computes)
    target = spec.target_compute or DEFAULT_TARGET_FACTOR * high
    # Each architecture's replicates from a seed of its own: the runs of two architectures are independent samples.
    fits = {arch: fit_arch(rows, spec, target, SEED + i) for i, (arch, rows) in enumerate(fitted.items())}
    pct = f"{spec.level:.0%}"
    header = ["arch", "runs", "alpha", "E", "A", f"loss at {sci(target)} FLOPs", "RMS log residual"]
    table = []
    for arch, fit in fits.items():
        if "theta" not in fit:
            table.append([arch, str(fit["runs"]), "", "", "", fit["why"], ""])
            continue
        table.append([arch, str(fit["runs"]), interval_text(fit["alpha"], fit["alpha_interval"]),
                      interval_text(fit["E"], fit["E_interval"]), f"{fit['A']:.3g}",
                      interval_text(fit["target_loss"], fit["target_interval"], ".4g"),
                      f"{fit['rms_log_residual']:.4f}"])
    cross = crossover_rows(fits, spec, low, target)
    images = ["ladder.png"]
    plot(fits, fitted, low, target, report_dir / "ladder.png", spec.level)
    if parabolas:
        plot_isoflop(parabolas, report_dir / "isoflop.png")
        images.append("isoflop.png")
    nd = {arch: nd_fit(rows, spec) for arch, rows in found.items()} if spec.budgets else {}

    lines = [f"# Ladder: {spec.path}", "",
             f"L(C) = E + A C^-alpha per architecture (C: training FLOPs, lm.accounting.flops), fitted by Huber loss "
             f"on log loss; [{pct} intervals] from {spec.bootstrap} bootstrap replicates over runs (seeds resampled "
             f"within each rung). The target compute is {sci(target)} FLOPs"
             + ("" if spec.target_compute else f" ({DEFAULT_TARGET_FACTOR:g}x the largest run: none was set)") + ".",
             "", markdown_table(header, table), "## Crossovers", "",
             f"Between the smallest run ({sci(low)} FLOPs) and the target. A crossover is reported when at least "
             f"{pct} of the paired replicates cross in that range; none when at most {1 - spec.level:.0%} do.", "",
             markdown_table(["pair", "verdict", "replicates crossing", "lower at the target"], cross)]
    if nd:
        lines += ["## L(N, D) = E + A N^-alpha + B D^-beta (all sizes of every budget)", "",
                  markdown_table(["arch", "alpha", "beta", "E"], [
                      [a, interval_text(f["alpha"], f["alpha_interval"]), interval_text(f["beta"], f["beta_interval"]),
                       interval_text(f["E"], f["E_interval"])] if f else [a, "too few runs", "", ""]
                      for a, f in nd.items()])]
        lines += ["## Iso-FLOP parabolas", "", markdown_table(["arch", "budget", "compute-optimal params", "loss"], [
            [a, sci(p["budget"]), count(p["params_opt"]) if p["params_opt"] else "no minimum",
             f"{p['loss_opt']:.4f}" if p["loss_opt"] else ""] for a, ps in parabolas.items() for p in ps])]
    else:
        lines += ["L(N, D) is not fitted: every run trains the same tokens per parameter, so N and D move together "
                  "(set budgets: for iso-FLOP runs).", ""]
    lines += ["## Learning rates", "", markdown_table(
        ["arch", "swept rung", "final loss by lr", "best lr", "rule"],
        [[arch, s["rung"], ", ".join(f"{lr:g}: {loss:.4f}" for lr, loss in s["losses"].items()),
          f"{s['best_lr']:.3g} ({s['found_by']})", r["rule"].describe() if r["rule"] else "none: every rung swept"]
         for arch, r in rules.items() for s in r["sweeps"]]),
        "## Runs", "", markdown_table(["arch", "rung", "seed", "lr", "params", "tokens", "compute", "final loss"], [
            [arch, r["rung"], r["seed"], f"{r['lr']:g}", f"{r['params']:,}", f"{r['tokens']:,}",
             sci(r["compute"]), f"{r['loss']:.4f}"] for arch, rows in found.items() for r in rows])]
    (report_dir / "ladder.md").write_text("\n".join(lines) + "\n")
    write_json(report_dir / "fits.json", {
        "target_compute": target, "level": spec.level,
        "fits": {a: {k: v for k, v in f.items() if k not in ("thetas", "target_samples")} for a, f in fits.items()},
        "crossovers": cross, "nd": nd, "parabolas": parabolas, "points": found, "fitted": fitted,
        "lr_rules": {arch: rule_record(r) for arch, r in rules.items()}}, indent=1)
    write_section(report_dir, "Scaling ladder: L(C) per architecture", header, table, images)
    report([str(dir_of(run)) for run in runs], out=str(report_dir / "compare"),
           title=f"lm compare ladder: {spec.path.name}", sections=[str(report_dir)],
           positions=[1, max(2, seq_len // 8), seq_len])
    print(f"lm compare ladder: wrote {report_dir / 'ladder.md'} and {report_dir / 'compare' / 'report.html'}")
    return report_dir

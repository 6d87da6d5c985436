"""`lm research mesa-ablation`: why Mesa trails Gated DeltaNet in `lm compare demo`, tested on the demo's shape (1M
parameters, the bundled corpus, seq_len 128) with more optimizer steps, so that the gates can move.

The settings file (configs/research/mesa_ablation.yaml) names the variants: each changes one thing from today's Mesa
(its options, its head count, or its lr), and Gated DeltaNet runs at the same seeds. This is not a full factorial:
one that crossed every change would not fit the 80 minutes on 2 cores it takes. Every variant is its own `lm
compare plan` at matched parameters (an output gate or a head shape that changes the count is paid for by the MLP).
Every run is `lm train` + `lm eval ppl`, two at a time, and `lm compare report` draws the tables and loss curves.

Under --out: data/, plan-VARIANT/ (configs), runs/VARIANT-lrLR-seedS, logs/, ablation.md (val ppl per setting: mean
and spread over seeds, NLL by position, where the gates went), nll_by_position.png and report/.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import yaml

from lm.util.errors import UserError
from lm.util.resources import shipped

SETTINGS = shipped("configs/research/mesa_ablation.yaml")


def load_variants(path: Path = SETTINGS) -> tuple[dict[str, tuple[str, dict, list[float], int | None]], list[int]]:
    """(name -> (mixer, options, lrs, n_heads or None), seeds) from the settings file
    (configs/research/mesa_ablation.yaml)."""
    if not Path(path).is_file():
        raise UserError(f"{path} not found: give --settings (configs/research/mesa_ablation.yaml of the source tree)")
    settings = yaml.safe_load(Path(path).read_text())
    variants = {name: (v["mixer"], v.get("options") or {}, v.get("lrs") or settings["lrs"], v.get("n_heads"))
                for name, v in settings["variants"].items()}
    return variants, settings["seeds"]


def run_name(variant: str, lr: float, seed: int) -> str:
    return f"{variant}-lr{lr:g}-seed{seed}"


def planned_configs(out: Path, base: dict, params: float, only: list[str] | None, variants: dict,
                    seeds: list[int]) -> list[tuple[str, str]]:
    """(run name, config path) for every run of the variants in `only` (None: all), in the settings' order."""
    from lm.compare.plan import plan

    configs = []
    for variant, (mixer, options, lrs, n_heads) in variants.items():
        if only and variant not in only:
            continue
        variant_base = out / f"base-{variant}.yaml"
        model = {**base["model"], "mixer_options": {mixer: options}} if options else base["model"]
        variant_base.write_text(yaml.safe_dump({**base, "model": model}, sort_keys=False))
        planned = plan(archs=mixer, params=params, base=str(variant_base), lrs={mixer: lrs}, seeds=seeds,
                       out=str(out / f"plan-{variant}"))
        for path in planned["archs"][0]["configs"]:
            config = yaml.safe_load(Path(path).read_text())
            if n_heads:
                config["model"] = with_heads(config["model"], n_heads, params)
                Path(path).write_text(yaml.safe_dump(config, sort_keys=False))
            configs.append((run_name(variant, config["optim"]["lr"], config["seed"]), path))
    return configs


def with_heads(model: dict, n_heads: int, params: float) -> dict:
    """The planned model with n_heads heads (of the same head_dim) and its MLP refitted to `params` as the plan fits
    it, so that a head shape (Gated DeltaNet's 2 heads with expand_v 2) is compared at matched parameters too."""
    from dataclasses import asdict, replace

    from lm.accounting.flops import param_count
    from lm.compare.plan import fit_mlp
    from lm.model import LMConfig

    cfg = fit_mlp(replace(LMConfig(**model), n_heads=n_heads), param_count, params)
    if cfg is None:
        raise UserError(f"no MLP width matches {params:g} parameters with {n_heads} heads")
    return {k: v for k, v in asdict(cfg).items() if k in model}


def mesa_gate_bias_drift(state_dict: dict, n_heads: int, **options) -> float:
    """The largest change of a Mesa gamma gate bias in `state_dict` from its init (gamma_init's biases)."""
    from lm.mixers.mesa import Mesa, gamma_bias

    init = gamma_bias(Mesa.check_options(options).gamma_init, n_heads)
    return max((w - init).abs().max().item() for k, w in state_dict.items() if k.endswith("gamma_proj.bias"))


# The mixers whose gate biases the table follows: name -> the largest change of a gate bias from its init.
GATE_BIAS_DRIFT = {"mesa": mesa_gate_bias_drift}


def gate_drift(run_dir: Path, mixer: str, options: dict, n_heads: int) -> tuple[str, str]:
    """Where a mixer's forget gates went in a run: the mean gamma over layers at its first and last logged training
    step (the `gamma_mean` metric in metrics.csv), and the largest change of a gate bias from its init (its
    GATE_BIAS_DRIFT, from the last checkpoint); blank for mixers that report neither."""
    import csv

    from lm.training.checkpoint import newest_checkpoint
    from lm.training.data_only import load

    if mixer not in GATE_BIAS_DRIFT:
        return "", ""
    rows = [r for path in sorted(run_dir.glob("logs/version_*/metrics.csv")) for r in csv.DictReader(open(path))]
    gammas = [float(r["train/gamma_mean"]) for r in rows if r.get("train/gamma_mean")]
    checkpoint = newest_checkpoint(run_dir / "checkpoints")
    if not gammas or checkpoint is None:
        return "", ""
    weights = load(checkpoint)["state_dict"]
    moved = GATE_BIAS_DRIFT[mixer](weights, n_heads, **options)
    return f"{gammas[0]:.3f} -> {gammas[-1]:.3f}", f"{moved:.2f}"


def seed_results(out: Path, variant: str, lr: float, seeds: list[int],
                 seq_len: int) -> list[tuple[Path, float, dict]]:
    """(run directory, val ppl, position -> NLL) of each seed whose `lm eval ppl` has finished."""
    from lm.eval.ppl import read_curve

    runs = [out / "runs" / run_name(variant, lr, seed) for seed in seeds]
    evals = [(run, run / "eval" / f"ppl-validation-T{seq_len}") for run in runs]
    return [(run, json.loads((e / "ppl.json").read_text())["ppl"], read_curve(e)) for run, e in evals
            if (e / "ppl.json").is_file()]


def mean_curve(curves: list[dict]) -> dict[int, float]:
    return {k: statistics.fmean(c[k] for c in curves) for k in curves[0]}


def ablation_table(out: Path, seq_len: int, variants: dict, seeds: list[int]) -> tuple[str, dict]:
    """One row per (variant, lr) from the run directories: val ppl (`lm eval ppl`) mean and spread (max - min) over
    seeds, the mean NLL at positions 1, 16 and seq_len, and for Mesa where the gates went (the first seed); and
    (variant, lr) -> the mean NLL by position, for the figure."""
    positions = sorted({1, min(16, seq_len), seq_len})
    header = ("setting", "options", "lr", "seeds", "val ppl (mean)", "spread", "val ppl per seed",
              *(f"NLL@{k}" for k in positions), "gamma mean, first -> last step", "max gate-bias change")
    lines, curves = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)], {}
    for variant, (mixer, options, lrs, n_heads) in variants.items():
        for lr in lrs:
            results = seed_results(out, variant, lr, seeds, seq_len)
            if not results:
                continue
            first, ppls, curve = results[0][0], [r[1] for r in results], mean_curve([r[2] for r in results])
            curves[variant, lr] = curve
            config = yaml.safe_load((first / "config.yaml").read_text())
            drift = gate_drift(first, mixer, options, config["model"]["n_heads"])
            shown = {**options, **({"n_heads": n_heads} if n_heads else {})}
            lines.append("| " + " | ".join((
                variant, ", ".join(f"{k}: {v}" for k, v in shown.items()) or "-", f"{lr:g}", str(len(ppls)),
                f"{statistics.fmean(ppls):.2f}", f"{max(ppls) - min(ppls):.2f}",
                " / ".join(f"{p:.2f}" for p in ppls), *(f"{curve[k]:.3f}" for k in positions), *drift)) + " |")
    return "\n".join(lines) + "\n", curves


def plot_nll_by_position(curves: dict, path: Path) -> None:
    """NLL by position (mean over seeds) of each setting at each lr, and its difference to the first Gated
    DeltaNet row at the same lr (else at its first lr)."""
    from lm.util.plotting import pyplot, save

    plt = pyplot()
    fig, (raw, diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    references = {}
    for (variant, lr), curve in curves.items():
        if variant.startswith("gated_deltanet"):
            references.setdefault(lr, curve)
    fallback = next(iter(references.values()), None)
    for i, ((variant, lr), curve) in enumerate(curves.items()):
        positions = sorted(curve)
        style = {"label": f"{variant} {lr:g}", "color": plt.get_cmap("tab20")(i % 20),
                 "linestyle": "--" if variant.startswith("gated_deltanet") else "-"}
        raw.plot(positions, [curve[k] for k in positions], **style)
        reference = references.get(lr, fallback)
        if reference is not None:
            diff.plot(positions, [curve[k] - reference[k] for k in positions], **style)
    raw.set(xscale="log", xlabel="position in sequence", ylabel="NLL (nats), mean over seeds")
    diff.set(xscale="log", xlabel="position in sequence", ylabel="NLL - Gated DeltaNet's at the same lr (nats)")
    diff.axhline(0, color="black", linewidth=0.8)
    for ax in raw, diff:
        ax.grid(alpha=0.3)
    raw.legend(fontsize=7, ncol=2)
    save(fig, path)


def mesa_ablation(out: str = "runs/mesa-ablation", params: float = 1e6, steps: int = 400, global_batch: int = 8,
                  seq_len: int = 128, vocab_size: int = 2048, data: str | None = None, workers: int = 2,
                  val_windows: int | None = None, only: list[str] | None = None, report_only: bool = False,
                  settings: str = str(SETTINGS)) -> dict:
    """Mesa's variants (configs/research/mesa_ablation.yaml) against Gated DeltaNet, with seeds (about 80 minutes on 2
    CPU cores, docs/mesa.md).

    Args:
        out: Where everything goes (see the module docstring); a rerun reuses the prepared data.
        params: Parameters of every model, matched within 2% by lm compare plan.
        steps: Optimizer steps of every run (warmup a tenth, cosine to 0.1x).
        global_batch: Sequences per step.
        seq_len: Training sequence length.
        vocab_size: BPE vocabulary of the bundled corpus.
        data: An already prepared dataset instead of the bundled corpus.
        workers: Runs at once, each in its own process with cpu_count / workers threads.
        val_windows: Validation windows, in training and in `lm eval ppl` (default: the whole validation split).
        only: Run only these variants (names in configs/research/mesa_ablation.yaml).
        report_only: Train nothing: the table and the report from the runs already under --out.
        settings: The variants, lrs and seeds (default: configs/research/mesa_ablation.yaml of the source tree).
    """
    import os
    from functools import partial

    from lm.compare.demo import base_config, check_out_and_data, prepared_data, progress, train_and_evaluate
    from lm.compare.report import report
    from lm.util.workers import run_jobs

    variants, seeds = load_variants(Path(settings))
    unknown = sorted(set(only or []) - set(variants))
    if unknown:
        raise UserError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(variants)}")
    for name, value in (("params", params), ("steps", steps), ("global_batch", global_batch), ("seq_len", seq_len),
                        ("workers", workers)):
        if value < 1:
            raise UserError(f"--{name} must be at least 1, got {value}")
    if val_windows is not None and val_windows < 1:
        raise UserError(f"--val_windows must be at least 1, got {val_windows}")
    start = time.perf_counter()
    out_dir = Path(out)
    check_out_and_data(out_dir, data, vocab_size)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    data, vocab = prepared_data(out_dir, data, vocab_size)
    base = base_config(data, vocab, seq_len, global_batch, val_windows)
    configs = planned_configs(out_dir, base, params, only, variants, seeds)
    val_every = max(1, steps // 4)
    overrides = ["--trainer.max_steps", str(steps), "--trainer.val_every", str(val_every), "--trainer.ckpt_every",
                 str(steps), "--trainer.log_every", str(max(1, min(10, steps // 10))), "--optim.warmup_steps",
                 str(max(1, steps // 10))]
    names = [name for name, _ in configs]
    if not report_only:
        threads = max(1, (os.cpu_count() or 1) // workers)
        jobs = {}
        for name, path in configs:
            run_overrides = ["--run_dir", str(out_dir / "runs" / name), *overrides]
            jobs[name] = partial(train_and_evaluate, path, run_overrides, val_windows)
        print(f"lm research mesa-ablation: {len(jobs)} runs of {steps} steps x {global_batch} x {seq_len} tokens, "
              f"{workers} at a time; logs in {out_dir / 'logs'}", file=sys.stderr)
        run_jobs(jobs, workers, threads, logs={name: out_dir / "logs" / f"{name}.log" for name in jobs},
                 done=progress("lm research mesa-ablation"))
    table, curves = ablation_table(out_dir, seq_len, variants, seeds)
    (out_dir / "ablation.md").write_text(table)
    if curves:
        plot_nll_by_position(curves, out_dir / "nll_by_position.png")
    report_dir = report([str(out_dir / "runs" / name) for name in names if (out_dir / "runs" / name).is_dir()],
                        out=str(out_dir / "report"), positions=[1, 16, seq_len],
                        title=f"Mesa ablation: {steps} steps x {global_batch} x {seq_len}")
    wall = time.perf_counter() - start
    print(f"\n{table}\nlm research mesa-ablation: {wall / 60:.1f} min; report: {report_dir / 'report.md'}")
    return {"table": table, "wall_s": wall}

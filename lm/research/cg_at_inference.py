"""`lm research test-time`: what more or fewer CG steps at evaluation buy a trained Mesa model, set against the
inference FLOPs per token they spend: the MesaNet paper's trade of test-time compute.

Each checkpoint of a model with a CG solve (a mixer with the options `cg_steps_eval` and `cg_tol`: Mesa, Hawk-Mesa)
is evaluated at every setting: a fixed number of CG steps (`steps`, 0 = no solve), and a relative-residual tolerance
(`tols`, at most the largest of `steps`). Any other model (Gated DeltaNet, attention) is evaluated once, as a fixed
point at its own cost. For each, on the same data:
- the validation loss and perplexity, and the NLL by position in the window (log-spaced positions);
- an offline recall probe: `lm eval longctx`'s `multikey` (lm.eval.longctx.probes, noise haystack) at `recall_lengths`
  (past the training length: the probe's instructions alone outgrow a short one), scored by the NLL of the asked
  number's tokens given the prompt (graded where a small model's greedy answer is never whole) and by whether greedy
  decoding would give every one of them;
- the inference FLOPs per token as spent (lm.accounting.flops.flops_spent_per_token after each forward: a tolerance
  counts the CG steps each solve ran, the slowest token of each loop), and those CG steps (mean over layers).

Outputs under --out: results.csv (one row per checkpoint and setting), nll_by_position.csv, test_time.md (the table:
mean over seeds with the spread between them) and test_time.png.
"""

import csv
import dataclasses
import math
import statistics
from pathlib import Path

import numpy as np
import torch
import yaml

from lm.accounting.flops import flops_spent_per_token
from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig
from lm.util.errors import UserError
from lm.util.output import markdown_table, write_json
from lm.util.plotting import pyplot, save

STEPS = (0, 1, 2, 4, 8, 16, 30)
TOLS = (1e-2, 1e-3, 1e-4)
RECALL_DEPTHS = (0.1, 0.5, 0.9)
SOLVER_OPTIONS = {"cg_steps_eval", "cg_tol"}  # what a mixer must have to be evaluated at every setting
TRAINED_SOLVER = ("cg_steps", "cg_tol")  # a run's own settings of these name it apart ("mesa@cg_tol=0.001")


def settings(steps: list[int], tols: list[float]) -> list[dict]:
    """The solver settings: each step count without a tolerance, then each tolerance at the most steps."""
    most = max(steps)
    return ([{"setting": f"cg {s}", "cg_steps_eval": s, "cg_tol": None} for s in steps]
            + [{"setting": f"tol {t:g}", "cg_steps_eval": most, "cg_tol": t} for t in tols])


def solvers(cfg: LMConfig) -> list[str]:
    """The mixers of a model whose CG solve the settings change (those with every one of SOLVER_OPTIONS)."""
    return [name for name in dict.fromkeys(cfg.layer_mixers())
            if SOLVER_OPTIONS <= {f.name for f in dataclasses.fields(MIXERS[name].Options)}]


def at_setting(model: LanguageModel, setting: dict) -> LanguageModel:
    """A model built anew with the solver options of `setting` and `model`'s weights, in eval mode (the built mixers'
    options are never changed in place: their settings decide how they were built)."""
    solve = {"cg_steps_eval": setting["cg_steps_eval"], "cg_tol": setting["cg_tol"]}
    options = {name: {**model.cfg.mixer_options.get(name, {}), **solve} for name in solvers(model.cfg)}
    built = LanguageModel(dataclasses.replace(model.cfg, mixer_options={**model.cfg.mixer_options, **options}))
    built.load_state_dict(model.state_dict())
    return built.eval()


def validation(model, windows: torch.Tensor, batch_size: int) -> dict:
    """Loss, NLL by position (a [T] array) and inference FLOPs per token as spent, over `windows` [N, T + 1]."""
    T = windows.shape[1] - 1
    sums, flops, steps = torch.zeros(T, dtype=torch.float64), 0.0, []
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            batch = windows[start:start + batch_size]
            nll, _ = model(batch[:, :-1], targets=batch[:, 1:], reduction="none")
            sums += nll.double().sum(0)
            flops += flops_spent_per_token(model, T, training=False) * len(batch)
            if (ran := model.mixer_metrics().get("cg_iterations_run")) is not None:
                steps.append(float(ran) * len(batch))
    by_position = (sums / len(windows)).numpy()
    return {"loss": float(by_position.mean()), "by_position": by_position, "flops": flops / len(windows),
            "cg_steps_run": sum(steps) / len(windows) if steps else None}


def recall_examples(tokenizer, lengths: list[int], per_length: int) -> dict[int, list[tuple[list[int], list[int]]]]:
    """Per length, (prompt ids, answer ids) of `multikey` examples: the asked needle at each of RECALL_DEPTHS, seeds
    0, 1, ... until `per_length` examples."""
    from lm.eval.longctx.probes import make_example

    found = {}
    for length in lengths:
        examples = []
        for i in range(per_length):
            example = make_example("multikey", tokenizer, length, RECALL_DEPTHS[i % len(RECALL_DEPTHS)], i,
                                   "noise", 2)
            prompt = tokenizer.encode(example.prompt, add_special_tokens=False).ids
            answer = tokenizer.encode(" " + example.answers[0], add_special_tokens=False).ids
            examples.append((prompt, answer))
        found[length] = examples
    return found


def recall(model, examples: list[tuple[list[int], list[int]]]) -> dict:
    """Mean NLL per answer token, the share of examples whose every answer token is the greedy choice, and the
    inference FLOPs per token as spent."""
    nll, correct, flops = [], 0, 0.0
    with torch.no_grad():
        for prompt, answer in examples:
            ids = torch.tensor([prompt + answer])
            logits, _ = model(ids[:, :-1])
            scored = logits[0, len(prompt) - 1:].float().log_softmax(-1)
            target = torch.tensor(answer)
            nll.append(float(-scored.gather(1, target[:, None]).mean()))
            correct += bool((scored.argmax(-1) == target).all())
            flops += flops_spent_per_token(model, ids.shape[1] - 1, training=False)
    return {"nll": statistics.mean(nll), "accuracy": correct / len(examples), "flops": flops / len(examples)}


def ladder_rung(run: Path) -> tuple[str, str] | None:
    """(arch, rung) of a run of `lm compare ladder` (OUT/runs/NAME: the header of OUT/configs/NAME.yaml names them), or
    None for another run."""
    config = run.parent.parent / "configs" / f"{run.name}.yaml"
    head = config.read_text().splitlines()[0] if config.is_file() else ""
    if " at rung " not in head:
        return None
    arch, rest = head.removeprefix("# ").split(" at rung ", 1)
    return arch, rest.split(":")[0]


def describe(run: Path) -> dict:
    """Arch (a ladder's name for it, such as mesa@cg_tol=1e-3), seed, data and length of a run directory."""
    from lm.model import LMConfig

    config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    rung = ladder_rung(run)
    model = LMConfig(**config["model"])
    # the mixer, or a hybrid's pattern joined by "+", as lm compare names it (a layer above this one)
    arch = "+".join(name.strip() for name in model.layer_pattern.split(",")) if model.layer_pattern else model.mixer
    for options in (config["model"].get("mixer_options") or {}).values():  # how it was trained to solve
        arch += "".join(f"@{key}={options[key]:g}" for key in TRAINED_SOLVER if key in options)
    return {"arch": rung[0] if rung else arch, "seed": config.get("seed"),
            "data": config.get("data", {}).get("path"), "seq_len": config.get("data", {}).get("seq_len")}


def largest_rung_runs(ladder_out: Path) -> list[Path]:
    """The finished runs of an `lm compare ladder` output's largest rung, every arch and seed."""
    runs = {}
    for run in sorted((ladder_out / "runs").iterdir()) if (ladder_out / "runs").is_dir() else []:
        rung = ladder_rung(run)
        if rung and (run / "checkpoints").is_dir():
            runs.setdefault(rung[1], []).append(run)
    if not runs:
        raise UserError(f"{ladder_out} holds no finished run of `lm compare ladder`")
    return runs[max(runs, key=lambda rung: max(parameters(run) for run in runs[rung]))]


def parameters(run: Path) -> int:
    from lm.accounting.flops import param_count
    from lm.model import LMConfig

    return param_count(LMConfig(**yaml.safe_load((run / "config.yaml").read_text())["model"]))


def cg_at_inference(runs: list[str] = [], ladder: str | None = None, out: str = "runs/test-time",  # noqa: B006
              steps: list[int] = list(STEPS), tols: list[float] = list(TOLS),  # noqa: B006
              max_windows: int | None = None, batch_size: int = 16, recall_lengths: list[int] = [512, 1024],  # noqa: B006
              recall_examples_per_length: int = 12) -> dict:
    """Evaluate trained checkpoints at every CG setting (a model without a solve once), against FLOPs per token.

    Args:
        runs: Run directories (their newest checkpoint) or checkpoint files.
        ladder: An `lm compare ladder` output directory: its largest rung's runs, every arch and seed, are added.
        out: Output directory.
        steps: CG step counts to evaluate at (0: no solve).
        tols: Relative-residual tolerances, each at the most steps.
        max_windows: Validation windows per evaluation (default: all).
        batch_size: Validation windows per forward pass.
        recall_lengths: Lengths of the recall probe's prompts, in the model's tokens.
        recall_examples_per_length: Recall examples at each length.
    """
    from tokenizers import Tokenizer

    from lm.training.checkpoint import load_model, resolve_checkpoint, run_dir_of
    from lm.training.data import TokenStream, ValidationWindows

    if not steps or min(steps) < 0 or any(not 0 < t < 1 for t in tols):
        raise UserError(f"--steps must be counts >= 0 and --tols lie in (0, 1), got {steps} and {tols}")
    for name, value in (("max_windows", max_windows), ("batch_size", batch_size),
                        ("recall_examples_per_length", recall_examples_per_length)):
        if value is not None and value < 1:
            raise UserError(f"--{name} must be at least 1, got {value}")
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    paths = [Path(r) for r in runs] + (largest_rung_runs(Path(ladder)) if ladder else [])
    if not paths:
        raise UserError("nothing to evaluate: pass --runs or --ladder")
    checkpoints = [resolve_checkpoint(p) for p in paths]  # every one checked before anything is evaluated or written
    described = [describe(run_dir_of(c)) for c in checkpoints]
    data = described[0]["data"]
    if any(d["data"] != data or d["seq_len"] != described[0]["seq_len"] for d in described):
        raise UserError("the runs were trained on different data or lengths; compare runs of one setting")
    stream = TokenStream(data, "validation", verify=False)
    windows = ValidationWindows(stream, described[0]["seq_len"], max_windows)
    windows = torch.stack([windows[i] for i in range(len(windows))])
    tokenizer = Tokenizer.from_file(str(run_dir_of(checkpoints[0]) / "tokenizer.json"))
    probes = recall_examples(tokenizer, recall_lengths, recall_examples_per_length)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)

    rows, curves = [], []
    for checkpoint, about in zip(checkpoints, described, strict=True):
        trained, _ = load_model(checkpoint)
        fixed = not solvers(trained.cfg)
        for setting in [{"setting": "fixed", "cg_steps_eval": None, "cg_tol": None}] if fixed else settings(steps,
                                                                                                             tols):
            model = trained if fixed else at_setting(trained, setting)
            val = validation(model, windows, batch_size)
            row = {"arch": about["arch"], "seed": about["seed"], "checkpoint": str(checkpoint), **setting,
                   "cg_steps_run": val["cg_steps_run"], "flops_per_token": val["flops"], "val_loss": val["loss"],
                   "val_ppl": math.exp(val["loss"])}
            for length, examples in probes.items():
                found = recall(model, examples)
                row.update({f"recall_nll_T{length}": found["nll"], f"recall_acc_T{length}": found["accuracy"],
                            f"flops_per_token_T{length}": found["flops"]})
            rows.append(row)
            curves += [{"arch": about["arch"], "seed": about["seed"], "setting": setting["setting"], "position": k,
                        "nll": float(val["by_position"][k - 1])} for k in positions(len(val["by_position"]))]
            print(f"lm research test-time: {about['arch']} seed {about['seed']} {setting['setting']}: "
                  f"{row['flops_per_token']:.4g} FLOPs/token, val loss {row['val_loss']:.4f}", flush=True)
    write_csv(out_dir / "results.csv", rows)
    write_csv(out_dir / "nll_by_position.csv", curves)
    summary = summarise(rows, recall_lengths)
    (out_dir / "test_time.md").write_text(table(summary, recall_lengths))
    plot(summary, curves, recall_lengths, out_dir / "test_time.png")
    write_json(out_dir / "summary.json", summary)
    print(f"wrote {out_dir / 'test_time.md'}, {out_dir / 'test_time.png'}, results.csv, nll_by_position.csv")
    return {"rows": rows, "summary": summary}


def positions(T: int, n: int = 24) -> list[int]:
    return sorted({max(1, min(T, round(math.exp(x)))) for x in np.linspace(0, math.log(T), n)})


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def summarise(rows: list[dict], lengths: list[int]) -> list[dict]:
    """Per arch and setting, over seeds: the mean of each figure and its spread (max - min)."""
    keys = ["flops_per_token", "val_loss", "val_ppl"] + [f"recall_{m}_T{n}" for n in lengths for m in ("nll", "acc")]
    groups = {}
    for row in rows:
        groups.setdefault((row["arch"], row["setting"]), []).append(row)
    summary = []
    for (arch, setting), group in groups.items():
        entry = {"arch": arch, "setting": setting, "seeds": len(group),
                 "cg_steps_run": statistics.mean(g["cg_steps_run"] for g in group) if group[0]["cg_steps_run"]
                 is not None else None}
        for key in keys:
            values = [g[key] for g in group]
            entry[key], entry[key + "_spread"] = statistics.mean(values), max(values) - min(values)
        summary.append(entry)
    return summary


def table(summary: list[dict], lengths: list[int]) -> str:
    header = ["arch", "setting", "seeds", "CG steps run", "inference FLOPs/token", "val loss (spread)", "val ppl"] + \
        [f"recall NLL T{n} (spread)" for n in lengths] + [f"recall acc T{n}" for n in lengths]
    body = [[s["arch"], s["setting"], s["seeds"], "" if s["cg_steps_run"] is None else f"{s['cg_steps_run']:.2f}",
             f"{s['flops_per_token']:.4g}",
             f"{s['val_loss']:.4f} ({s['val_loss_spread']:.4f})", f"{s['val_ppl']:.3f}"]
            + [f"{s[f'recall_nll_T{n}']:.3f} ({s[f'recall_nll_T{n}_spread']:.3f})" for n in lengths]
            + [f"{s[f'recall_acc_T{n}']:.2f}" for n in lengths] for s in summary]
    return markdown_table(header, body) + "\n"


def plot(summary: list[dict], curves: list[dict], lengths: list[int], path: Path) -> None:
    """Validation loss and recall NLL against inference FLOPs per token (one line per arch, seeds' spread as error
    bars), and the NLL by position of each setting (mean over seeds)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 + 1, figsize=(16, 4.5))
    panels = [("val_loss", "validation loss"), (f"recall_nll_T{lengths[-1]}", f"recall NLL per answer token, "
                                                                             f"T {lengths[-1]}")]
    for ax, (key, label) in zip(axes, panels, strict=False):
        for arch in dict.fromkeys(s["arch"] for s in summary):
            mine = [s for s in summary if s["arch"] == arch]
            ax.errorbar([s["flops_per_token"] for s in mine], [s[key] for s in mine],
                        yerr=[s[key + "_spread"] / 2 for s in mine], marker="o", capsize=3, label=arch,
                        linestyle="-" if len(mine) > 1 else "none")
            for s in mine:
                if len(mine) > 1:
                    ax.annotate(s["setting"], (s["flops_per_token"], s[key]), fontsize=6)
        ax.set(xscale="log", xlabel="inference FLOPs per token (as spent)", ylabel=label)
        ax.legend(fontsize=7)
    ax = axes[-1]
    by = {}
    for c in curves:
        by.setdefault((c["arch"], c["setting"]), {}).setdefault(c["position"], []).append(c["nll"])
    for (arch, setting), points in by.items():
        xs = sorted(points)
        ax.plot(xs, [statistics.mean(points[x]) for x in xs], label=f"{arch} {setting}", linewidth=1)
    ax.set(xscale="log", xlabel="position in the window", ylabel="NLL (mean over seeds)")
    ax.legend(fontsize=5, ncol=2)
    save(fig, path)

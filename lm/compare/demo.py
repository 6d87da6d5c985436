"""`lm compare demo`: the showcase comparison on a 2-core CPU. Every registered mixer and the MesaNet paper's hybrids
(lm/compare/paper_sizes.py) at matched parameters (lm compare plan) train on the bundled corpus for the same tokens,
`lm eval ppl` evaluates each, `lm eval mqar` probes recall, a quick `lm eval icl` in-context regression, and
`lm compare report` puts it all side by side, the MQAR table and the regression's section included.

Layout under --out: data/ (the prepared corpus, reused by a rerun), base.yaml, plan/ (plan.md, configs), runs/ARCH
(one `lm train` run each, with eval/), logs/ (each job's output), mqar.{md,json,csv}, icl/, summary.md and
report/.

The jobs run in worker processes, one thread each, two at a time on two cores, so both cores stay busy throughout.
The costliest (most training FLOPs per token, Mesa's CG first) start first, so both workers finish about together.
"""

import csv
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import yaml

from lm.util.errors import UserError
from lm.util.output import write_json
from lm.util.workers import run_jobs

# Each mixer trains at its LRS entry (a hybrid at its first mixer's), one run each, not swept: configs/demo.yaml's
# 3e-3 for attention, SWA and mLSTM, and a little more (DEFAULT_LR) for the others and for a mixer not listed, on the
# guess that they take a higher lr. A real comparison sweeps them (lm compare plan --lrs).
DEFAULT_LR = 4e-3
LRS = {"attention": 3e-3, "swa": 3e-3, "mlstm": 3e-3}
VAL_POINTS = 8  # validations per run: the loss curves' points
MQAR_COLUMNS = ("mixer", "params", "state floats", "steps", "accuracy", "final loss", "seconds")


def train_and_evaluate(config: str, overrides: list[str], eval_windows: int | None,
                       positions: str | None = None) -> dict:
    """One job: `lm train` on a planned config, then `lm eval ppl` (with `positions`) on its last checkpoint."""
    start = time.perf_counter()
    from lm.eval.ppl import evaluate_ppl
    from lm.training.config import parse_run_config
    from lm.training.train import train

    run, resume, resolved = parse_run_config(["--config", config, *overrides])
    checkpoint = train(run, resume, resolved)
    result = evaluate_ppl(str(checkpoint), max_windows=eval_windows, positions=positions)
    return {"ppl": result["ppl"], "seconds": time.perf_counter() - start}


def demo_archs() -> list[str]:
    """Every registered mixer, then the MesaNet paper's hybrids (lm/compare/paper_sizes.py's PAPER_HYBRIDS)."""
    from lm.compare.plan import named_hybrids
    from lm.mixers import MIXERS

    return [*MIXERS, *named_hybrids(paper_only=True)]


def demo_lr(arch: str) -> float:
    """The demo's learning rate of `arch` (a mixer, or a hybrid: its first mixer's)."""
    from lm.compare.plan import parse_archs

    return LRS.get(parse_archs([arch])[0].mixers[0], DEFAULT_LR)


def mqar_job(mixers: list[str], steps: int | None) -> dict:
    """The other jobs: `lm eval mqar`, a 2-layer model of each mixer on multi-query associative recall."""
    start = time.perf_counter()
    from lm.eval.mqar import mqar_table

    # The blocks as trained here, each with its defaults (not `lm eval mqar`'s options: mLSTM stays xLSTM 7B's).
    rows = mqar_table(mixers=mixers, steps=steps, mixer_options={name: {} for name in mixers})
    return {"rows": rows, "seconds": time.perf_counter() - start}


def icl_job(mixers: list[str], steps: int | None, out: Path) -> dict:
    """One more job: `lm eval icl --quick`, one minimal layer of each mixer on in-context linear regression."""
    start = time.perf_counter()
    from lm.eval.icl import QUICK, icl

    icl(mixers=mixers, **{**QUICK, "steps": steps or QUICK["steps"]}, processes=1, out=str(out))
    return {"seconds": time.perf_counter() - start}


def progress(command: str):
    """The `done` of lm.util.workers.run_jobs for training jobs: a line on stderr as each ends, headed by `command`."""
    def done(name: str, result: dict) -> None:
        ppl = f", validation ppl {result['ppl']:.2f}" if "ppl" in result else ""
        print(f"{command}: {name} done in {result['seconds']:.0f} s{ppl}", file=sys.stderr)

    return done


def check_out_and_data(out: Path, data: str | None, vocab_size: int) -> None:
    """What writing into `out` and `prepared_data` would fail on, checked before anything is written."""
    from lm.data_prep.tokenizer import check_vocab_size

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    if data is None:
        check_vocab_size(vocab_size)
    elif not (Path(data) / "manifest.json").is_file():
        raise UserError(f"--data {data} is not a prepared dataset (no manifest.json; `lm prepare` writes one)")


def prepared_data(out: Path, data: str | None, vocab_size: int) -> tuple[str, int]:
    """(data directory, tokenizer vocabulary): `data` if given, else the bundled corpus prepared into OUT/data
    (lm prepare reuses an identical earlier result)."""
    if data is None:
        from lm.data_prep.prepare import BUNDLED_CORPUS, prepare

        data = str(out / "data")
        prepare([str(BUNDLED_CORPUS)], data, vocab_size=vocab_size, progress=False)
    manifest = Path(data) / "manifest.json"
    if not manifest.is_file():
        raise UserError(f"--data {data} is not a prepared dataset (no manifest.json; `lm prepare` writes one)")
    return data, json.loads(manifest.read_text())["tokenizer"]["vocab_size"]


def base_config(data: str, vocab: int, seq_len: int, global_batch: int, val_windows: int | None) -> dict:
    """The sections lm compare plan copies into every config; the steps and lr are set per run. Validation sees the
    windows `lm eval ppl` sees, so the report's final validation loss is that of the evaluation."""
    return {"seed": 0, "model": {"vocab_size": vocab, "max_seq_len": seq_len, "logit_soft_cap": 30.0},
            "data": {"path": data, "seq_len": seq_len, "micro_batch": global_batch, "global_batch": global_batch,
                     "num_workers": 0, "val_windows": val_windows},
            "optim": {"lr": 3e-3, "weight_decay": 0.1, "min_lr_ratio": 0.1},
            "trainer": {"keep_last": 1, "progress_bar": False}, "strategy": {"accelerator": "cpu", "devices": 1}}


def mqar_cells(row: dict) -> list[str]:
    return [row["mixer"], f"{row['params']:,}", f"{row['state_floats']:,}", str(row["steps"]),
            f"{row['accuracy']:.1%}", f"{row['final_loss']:.3f}", f"{row['seconds']:.0f}"]


def write_mqar(out: Path, rows: list[dict]) -> Path:
    """mqar.md (the table as `lm eval mqar` prints it) and mqar.csv (for the report)."""
    from lm.eval.mqar import MQARTask

    task = MQARTask(vocab=32, pairs=4)  # mqar_table's defaults
    lrs = [row["lr"] for row in rows]
    common = max(set(lrs), key=lrs.count)
    others = ", ".join(f"{row['mixer']} {row['lr']:g}" for row in rows if row["lr"] != common)
    lines = [f"MQAR (`lm eval mqar`): vocab {task.vocab}, {task.pairs} pairs, length {task.seq_len}, 2 layers, "
             f"d_model 64, batch 64, lr {common:g}{f' ({others})' if others else ''}; accuracy on fresh sequences "
             "(docs/mqar.md).", "",
             "| " + " | ".join(MQAR_COLUMNS) + " |", "|" + " --- |" * len(MQAR_COLUMNS)]
    lines += ["| " + " | ".join(mqar_cells(row)) + " |" for row in rows]
    (out / "mqar.md").write_text("\n".join(lines) + "\n")
    with open(out / "mqar.csv", "w", newline="") as f:
        csv.writer(f).writerows([MQAR_COLUMNS, *map(mqar_cells, rows)])
    return out / "mqar.csv"


def summary_table(report_csv: Path, mqar: list[dict], icl: list[dict], seq_len: int, archs: list[str]) -> str:
    """One row per architecture (as the report names it: a hybrid's mixers joined by "+"): the report's numbers for
    its run and, for a single mixer, its MQAR accuracy and its regression's excess loss over ridge."""
    with open(report_csv) as f:
        runs = {row["arch"]: row for row in csv.DictReader(f)}
    accuracy = {row["mixer"]: row["accuracy"] for row in mqar}
    over_ridge = {line["model"]: line["over_ridge"] for line in icl}

    def num(row: dict, key: str, form: str) -> str:
        return format(float(row[key]), form) if row.get(key) else ""

    header = ("arch", "lr", "params", "tokens", "val loss", "val ppl", f"NLL@{seq_len}", "tokens/s",
              "train time (s)", "MQAR accuracy", "ICL excess over ridge")
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for arch in archs:
        row = runs.get(arch, {})
        cells = (arch, num(row, "best lr", "g"), num(row, "params", ",.0f"), num(row, "tokens", ",.0f"),
                 num(row, "val loss", ".3f"), num(row, "val ppl", ".1f"), num(row, f"NLL@{seq_len}", ".3f"),
                 num(row, "tokens/s", ",.0f"), num(row, "wall time (s)", ".0f"),
                 f"{accuracy[arch]:.1%}" if arch in accuracy else "",
                 f"{over_ridge[arch]:+.0%}" if arch in over_ridge else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare_demo(out: str = "runs/compare-demo", params: float = 1e6, tokens: float = 4.5e5, seq_len: int = 128,
                 global_batch: int = 16, vocab_size: int = 2048, data: str | None = None, workers: int = 2,
                 steps: int | None = None, mqar_steps: int | None = None, icl_steps: int | None = None,
                 eval_windows: int | None = None, archs: list[str] | None = None) -> dict:
    """Every mixer and the paper's hybrids at matched parameters on the bundled corpus, every mixer on MQAR, then the
    report (docs/compare-demo.md has its time on 2 CPU cores).

    Args:
        out: Where everything goes: data/, plan/, runs/, logs/, mqar.md, summary.md, report/.
        params: Parameters of every model (tied embedding included), matched within 2% by lm compare plan.
        tokens: Training tokens of every run (the same for all; rounded to whole steps).
        seq_len: Training sequence length.
        global_batch: Sequences per optimizer step.
        vocab_size: BPE vocabulary of the bundled corpus.
        data: An already prepared dataset (`lm prepare`) to use instead of the bundled corpus.
        workers: Jobs run at once, each in its own process with cpu_count / workers threads.
        steps: Optimizer steps of every run instead of --tokens (a few for a quick check).
        mqar_steps: MQAR training steps of every mixer (default: each mixer's in `lm eval mqar`).
        icl_steps: Training steps of each in-context regression model (default: `lm eval icl --quick`'s).
        eval_windows: Validation windows, in training and in `lm eval ppl` (default: the whole validation split).
        archs: Architectures as `lm compare plan --archs` takes them (default: every mixer and the MesaNet paper's
            hybrids); MQAR runs their mixers.
    """
    from lm.compare.plan import parse_archs, plan
    from lm.compare.report import report

    start = time.perf_counter()
    if params <= 0 or tokens <= 0:
        raise UserError("--params and --tokens must be positive")
    for name, value in (("seq_len", seq_len), ("global_batch", global_batch), ("workers", workers),
                        ("steps", steps), ("mqar_steps", mqar_steps), ("icl_steps", icl_steps),
                        ("eval_windows", eval_windows)):
        if value is not None and value < 1:
            raise UserError(f"--{name} must be at least 1, got {value}")
    archs = demo_archs() if archs is None else list(archs)
    parse_archs(archs)
    out_dir = Path(out)
    check_out_and_data(out_dir, data, vocab_size)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    data, vocab = prepared_data(out_dir, data, vocab_size)
    steps = steps or max(1, round(tokens / (global_batch * seq_len)))
    val_every = max(1, round(steps / VAL_POINTS))
    steps = val_every * max(1, round(steps / val_every))  # the last step is validated too
    base = out_dir / "base.yaml"
    base.write_text(yaml.safe_dump(base_config(data, vocab, seq_len, global_batch, eval_windows), sort_keys=False))

    lrs = {arch: demo_lr(arch) for arch in archs}
    planned = plan(archs=archs, params=params, base=str(base), lrs={a: [lr] for a, lr in lrs.items()},
                   out=str(out_dir / "plan"))
    labels = [row["arch"] for row in planned["archs"]]
    patterns = [(row["layer_pattern"] or row["arch"]).split(",") for row in planned["archs"]]
    mixers = list(dict.fromkeys(m for pattern in patterns for m in pattern))
    trained = steps * global_batch * seq_len
    with open(out_dir / "plan" / "plan.md", "a") as f:
        f.write(f"\nlm compare demo trains every architecture for the same {trained:,} tokens ({steps} steps of "
                f"{global_batch} x {seq_len}), not the tokens and steps above.\n")
    threads = max(1, (os.cpu_count() or 1) // workers)
    overrides = ["--trainer.max_steps", str(steps), "--trainer.val_every", str(val_every), "--trainer.ckpt_every",
                 str(steps), "--trainer.log_every", str(max(1, min(10, steps // 10))), "--optim.warmup_steps",
                 str(max(1, steps // 10))]
    logs = out_dir / "logs"
    jobs = {}
    for row in planned["archs"]:
        run_overrides = ["--run_dir", str(out_dir / "runs" / row["arch"]), *overrides]
        jobs[row["arch"]] = partial(train_and_evaluate, row["configs"][0], run_overrides, eval_windows)
    # Costliest first: runs by training FLOPs per token (a proxy), with the probes (MQAR with each mixer's in one of
    # two jobs, to share them between the workers; the regression in a third) after the costliest run.
    by_cost = sorted(planned["archs"], key=lambda row: -row["train_flops_per_token"])
    probe_jobs = {}
    for part in range(min(2, len(mixers))):
        probe_jobs[f"mqar-{part + 1}"] = partial(mqar_job, mixers[part::2], mqar_steps)
    probe_jobs["icl"] = partial(icl_job, mixers, icl_steps, out_dir / "icl")
    order = [by_cost[0]["arch"], *probe_jobs, *(row["arch"] for row in by_cost[1:])]
    jobs.update(probe_jobs)
    print(f"lm compare demo: {len(labels)} runs of {trained:,} tokens and the probes, {workers} at a time with "
          f"{threads} thread(s) each; logs in {logs}", file=sys.stderr)
    results = run_jobs({name: jobs[name] for name in order}, workers, threads,
                       logs={name: logs / f"{name}.log" for name in order}, done=progress("lm compare demo"))

    mqar_rows = {row["mixer"]: row for name in probe_jobs if name.startswith("mqar") for row in results[name]["rows"]}
    mqar = [mqar_rows[m] for m in mixers]
    write_json(out_dir / "mqar.json", mqar)
    report_dir = report([str(out_dir / "runs" / arch) for arch in labels], out=str(out_dir / "report"),
                        positions=[seq_len // 8, seq_len // 2, seq_len],
                        title=f"lm compare demo: {len(labels)} architectures at {params / 1e6:g}M parameters, "
                              f"{trained:,} tokens each",
                        tables={"MQAR recall (lm eval mqar)": str(write_mqar(out_dir, mqar))},
                        sections=[str(out_dir / "icl")])
    icl = json.loads((out_dir / "icl" / "icl.json").read_text())["summary"]
    table = summary_table(report_dir / "report.csv", mqar, icl, seq_len, ["+".join(pattern) for pattern in patterns])
    wall = time.perf_counter() - start
    (out_dir / "summary.md").write_text(table)
    print(f"\n{table}\nlm compare demo: {wall:.0f} s ({wall / 60:.1f} min) in all; report: "
          f"{report_dir / 'report.html'} and {report_dir / 'report.md'}")
    return {"wall_s": wall, "steps": steps, "tokens": trained, "table": table, "report": str(report_dir),
            "mqar": mqar, "ppl": {arch: results[arch]["ppl"] for arch in labels},
            "params": {row["arch"]: row["params"] for row in planned["archs"]}, "lr": lrs}

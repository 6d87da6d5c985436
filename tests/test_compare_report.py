"""`lm compare report` builds from fixture runs: one real tiny `lm train` with real `lm eval ppl` and `lm eval longctx`
outputs, copied into other architectures and learning rates by editing config.yaml and the logged values, so every
file the report reads has the format the real commands write."""

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lm.accounting.flops import param_count, train_flops_per_token
from lm.cli import main
from lm.model import LMConfig

PLOTS = ["loss_vs_flops.png", "loss_vs_tokens.png", "lr_grid.png", "nll_vs_attention.png", "longctx_grids.png"]


@pytest.fixture(scope="module")
def trained_run(kjv_data, tmp_path_factory) -> Path:
    """A tiny attention model: 4 steps of `lm train` (validated after 2 and 4), evaluated at T=64 and T=2048 and on a
    small passkey grid."""
    tmp = tmp_path_factory.mktemp("compare-report")
    config = tmp / "run.yaml"
    config.write_text(f"""
model: {{vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 2, head_dim: 16, max_seq_len: 64}}
data: {{path: {kjv_data}, seq_len: 64, micro_batch: 4, num_workers: 0, val_windows: 2}}
optim: {{lr: 0.003}}
trainer: {{max_steps: 4, val_every: 2, ckpt_every: 4, log_every: 1, progress_bar: false, peak_flops: 1.0e+12}}
strategy: {{accelerator: cpu}}
run_dir: {tmp / "attention-lr3e-3"}
""")
    subprocess.run([sys.executable, "-m", "lm.cli", "train", "--config", str(config)], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    run = tmp / "attention-lr3e-3"
    assert main(["eval", "ppl", "--checkpoint", str(run), "--multiples", "[1, 32]", "--max_windows", "2"]) == 0
    assert main(["eval", "longctx", "--checkpoint", str(run), "--probes", "[passkey]", "--lengths", "[256]",
                 "--depths", "[0.0, 1.0]", "--samples", "1", "--max_new_tokens", "4"]) == 0
    write_harness_results(run)
    return run


def write_harness_results(run: Path) -> None:
    """results.json as `lm eval harness --suite standard` writes it (lm-eval's task data is not here offline)."""
    out = run / "eval" / "harness-standard"
    out.mkdir(parents=True)
    results = {"piqa": {"alias": "piqa", "acc,none": 0.55, "acc_stderr,none": 0.01, "acc_norm,none": 0.56},
               "hellaswag": {"alias": "hellaswag", "acc,none": 0.26, "acc_norm,none": 0.27,
                             "acc_norm_stderr,none": 0.1}}
    (out / "results.json").write_text(json.dumps({"checkpoint": str(run), "suite": "standard", "num_fewshot": 0,
                                                  "limit": None, "results": results, "versions": {}}, indent=1))


def shift_column(path: Path, columns: list[str], delta: float | None) -> None:
    """Add delta to every value logged in `columns` of a CSV file (None: blank them), keeping its layout and its time
    stamp (the report takes the newest eval of a run)."""
    stamp = path.stat()
    with open(path) as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    for row in rows:
        for column in columns:
            if row.get(column):
                row[column] = "" if delta is None else repr(float(row[column]) + delta)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))


def derive(source: Path, name: str, delta: float, model: dict | None = None, lr: float | None = None,
           seed: int | None = None, keep_evals: bool = True, keep_logs: bool = True) -> Path:
    """A copy of the run as another architecture / lr / seed, its losses and per-position NLL moved by delta (nan:
    diverged); without its evaluations or logs if asked."""
    run = source.parent / name
    shutil.copytree(source, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"].update(model or {})
    config["optim"]["lr"] = config["optim"]["lr"] if lr is None else lr
    config["seed"] = config["seed"] if seed is None else seed
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for metrics in (run / "logs").rglob("metrics.csv"):
        shift_column(metrics, ["train/loss", "val/loss"], delta)
        if model:  # the FLOPs the source's model spent are not this one's: the report counts them (analytic)
            shift_column(metrics, ["train/flops"], None)
    if not keep_logs:
        shutil.rmtree(run / "logs")
    if keep_evals:
        for curve in (run / "eval").glob("ppl-*/per_position.csv"):
            shift_column(curve, ["nll", "running_mean"], delta)
    else:
        shutil.rmtree(run / "eval")
    return run


@pytest.fixture(scope="module")
def fixture_runs(trained_run) -> dict[str, Path]:
    mesa = {"mixer": "mesa"}
    return {
        "attention lr 3e-3": trained_run,
        "attention lr 1e-3": derive(trained_run, "attention-lr1e-3", +0.1, lr=0.001),
        "attention lr 1e-2": derive(trained_run, "attention-lr1e-2", math.nan, lr=0.01),
        # Mesa: the single lowest loss is at lr 3e-3 (seed 0), but the lowest mean over seeds is at lr 1e-3.
        "mesa lr 3e-3 seed 0": derive(trained_run, "mesa-lr3e-3-s0", -0.5, mesa),
        "mesa lr 3e-3 seed 1": derive(trained_run, "mesa-lr3e-3-s1", +0.5, mesa, seed=1),
        "mesa lr 1e-3": derive(trained_run, "mesa-lr1e-3", -0.2, mesa, lr=0.001),
        # Never evaluated: its eval cells are blank.
        "gated_deltanet": derive(trained_run, "gdn", +0.3, {"mixer": "gated_deltanet", "d_model": 48},
                                 keep_evals=False),
        "hybrid": derive(trained_run, "hybrid", -0.1, {"layer_pattern": "mesa,attention"}),
        # Its logs lost as well: the steps come from its checkpoint, the losses are blank.
        "deltanet": derive(trained_run, "deltanet", 0.0, {"mixer": "deltanet"}, keep_evals=False, keep_logs=False),
    }


@pytest.fixture(scope="module")
def report_dir(fixture_runs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "x"
    assert main(["compare", "report", *map(str, fixture_runs.values()), "--out", str(out)]) == 0
    return out


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Each markdown table as rows of cells (header first, the --- line dropped)."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if not all(set(c) <= {"-", " "} for c in cells):
                current.append([c.strip() for c in cells])
        elif current:
            tables.append(current)
            current = []
    return tables


def test_one_row_per_arch_with_params_flops_tokens_and_throughput(report_dir):
    rows = {row["arch"]: row for row in read_csv(report_dir / "report.csv")}
    assert sorted(rows) == ["attention", "deltanet", "gated_deltanet", "mesa", "mesa+attention"]
    assert list(rows)[0] == "attention"  # the reference comes first
    for row in rows.values():
        config = yaml.safe_load((Path(row["run"]) / "config.yaml").read_text())
        model = LMConfig(**config["model"])
        assert int(row["params"]) == param_count(model)
        assert int(row["params w/o embeddings"]) == param_count(model, embeddings=False)
        assert int(row["tokens"]) == 4 * 4 * 64  # steps x global batch x seq_len
        assert float(row["FLOPs"]) == pytest.approx(train_flops_per_token(model, 64) * 4 * 4 * 64, rel=1e-12)
        if row["arch"] != "deltanet":
            assert math.exp(float(row["val loss"])) == pytest.approx(float(row["val ppl"]))
    assert int(rows["gated_deltanet"]["params"]) > int(rows["attention"]["params"])  # d_model 48
    attention = rows["attention"]
    logged = read_csv(next((Path(attention["run"]) / "logs").rglob("metrics.csv")))
    assert float(attention["val loss"]) == pytest.approx(float([r for r in logged if r["val/loss"]][-1]["val/loss"]))
    assert float(attention["wall time (s)"]) == pytest.approx(max(float(r["train/time"]) for r in logged
                                                                  if r["train/time"]))
    assert float(attention["tokens/s"]) > 0 and 0 < float(attention["MFU"]) < 1


def test_best_lr_has_the_lowest_mean_val_loss(report_dir):
    grid = read_csv(report_dir / "lr_grid.csv")
    for arch in {row["arch"] for row in grid}:
        runs = [row for row in grid if row["arch"] == arch]
        if not any(r["val loss"] for r in runs):
            assert not any(r["best"] for r in runs)  # nothing to rank by
            continue
        means = {lr: sum(float(r["val loss"]) for r in runs if r["lr"] == lr) / sum(r["lr"] == lr for r in runs)
                 for lr in {r["lr"] for r in runs}}
        best = min(means, key=lambda lr: means[lr] if math.isfinite(means[lr]) else math.inf)
        assert {r["lr"] for r in runs if r["best"].startswith("best lr")} == {best}
        assert sum(r["best"] == "best lr (shown)" for r in runs) == 1
    rows = {row["arch"]: row for row in read_csv(report_dir / "report.csv")}
    assert float(rows["mesa"]["best lr"]) == 0.001  # though the single lowest mesa loss is at 0.003
    assert float(rows["attention"]["best lr"]) == 0.003
    assert rows["mesa"]["seeds"] == "1"


def test_csv_and_markdown_agree(report_dir):
    tables = markdown_tables((report_dir / "report.md").read_text())
    assert len(tables) == 2
    for table, csv_name in zip(tables, ["report.csv", "lr_grid.csv"]):
        with open(report_dir / csv_name) as f:
            from_csv = list(csv.reader(f))
        assert table[0] == from_csv[0]
        assert len(table) == len(from_csv)
        for shown, raw in zip(table[1:], from_csv[1:]):
            for cell, value in zip(shown, raw):
                try:
                    assert float(cell.replace(",", "")) == pytest.approx(float(value), rel=1e-3, nan_ok=True)
                except ValueError:
                    assert cell == value


def test_missing_eval_pieces_are_blank_cells(report_dir):
    rows = {row["arch"]: row for row in read_csv(report_dir / "report.csv")}
    evals = ["NLL@64", "NLL@512", "NLL@2048", "piqa/acc", "hellaswag/acc_norm", "longctx-noise/passkey"]
    assert all(rows["attention"][column] != "" for column in evals)
    assert all(rows["gated_deltanet"][column] == "" for column in evals)
    assert rows["gated_deltanet"]["val loss"] != ""
    no_logs = rows["deltanet"]
    assert [no_logs[c] for c in ["best lr", "train loss", "val loss", "val ppl", "tokens/s", "MFU", "wall time (s)"]] \
        == [""] * 7
    assert int(no_logs["tokens"]) == 4 * 4 * 64  # steps from its checkpoint step=00000004.ckpt
    # The newest curve is T=2048; NLL@512 is its logged position nearest at or below 512.
    with open(Path(rows["attention"]["run"]) / "eval" / "ppl-validation-T2048" / "per_position.csv") as f:
        curve = {int(r["position"]): float(r["nll"]) for r in csv.DictReader(f)}
    assert float(rows["attention"]["NLL@512"]) == pytest.approx(curve[max(p for p in curve if p <= 512)])
    assert float(rows["mesa"]["NLL@2048"]) == pytest.approx(curve[2048] - 0.2)  # the best mesa run is lr 1e-3


def test_every_plot_exists_and_shows_something(report_dir):
    from matplotlib.image import imread

    for name in PLOTS:
        path = report_dir / name
        assert path.is_file() and path.stat().st_size > 5000, name
        assert imread(path)[..., :3].std() > 0.05, name  # not a blank canvas


def test_html_is_one_self_contained_page(report_dir):
    html = (report_dir / "report.html").read_text()
    assert html.count("<table>") == 2
    for arch in ["attention", "gated_deltanet", "mesa+attention", "hellaswag/acc_norm"]:
        assert f">{arch}<" in html
    assert html.count('src="data:image/png;base64,') == len(PLOTS)
    assert "src=" not in html.replace('src="data:image/png;base64,', "")
    assert "http://" not in html and "https://" not in html and "<link" not in html and "<script" not in html


def test_a_path_that_is_no_run_directory_exits_2_with_one_line(fixture_runs, tmp_path):
    not_a_run = tmp_path / "notes"
    not_a_run.mkdir()
    result = subprocess.run([sys.executable, "-m", "lm.cli", "compare", "report", str(fixture_runs["hybrid"]),
                             str(not_a_run), "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"lm compare report: error: {not_a_run} is not a run directory (no config.yaml; `lm train` writes one into "
        f"its run_dir)"]
    assert not (tmp_path / "out").exists()


def test_probe_outputs_are_sections_with_their_figures(fixture_runs, tmp_path):
    from lm.eval.icl import icl

    icl(mixers=["gla"], blocks=["minimal"], layers=[1], x_dim=3, length=8, steps=2, eval_sequences=64, processes=1,
        out=str(tmp_path / "icl"))
    out = tmp_path / "report"
    assert main(["compare", "report", str(fixture_runs["hybrid"]), "--out", str(out), "--sections",
                 f"[{tmp_path / 'icl'}]"]) == 0
    text = (out / "report.md").read_text()
    section = text.split("## In-context linear regression (lm eval icl)")[1].split("\n## ")[0]
    assert markdown_tables(section)[0][1][:3] == ["gla", "minimal", "1"]
    assert "](icl.png)" in text and (out / "icl.png").is_file()
    assert "In-context linear regression" in (out / "report.html").read_text()


def test_a_probe_folder_without_its_output_exits_2_before_writing(fixture_runs, tmp_path, capsys):
    assert main(["compare", "report", str(fixture_runs["hybrid"]), "--out", str(tmp_path / "out"), "--sections",
                 f"[{tmp_path}]"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"lm compare report: error: {tmp_path / 'section.json'} not found: --sections takes output folders of probes "
        "that write one (lm eval icl, lm eval mqar-grid)"]
    assert not (tmp_path / "out").exists()
    (tmp_path / "section.json").write_text('{"heading": "x"}')
    assert main(["compare", "report", str(fixture_runs["hybrid"]), "--out", str(tmp_path / "out"), "--sections",
                 f"[{tmp_path}]"]) == 2
    assert "is not a report section" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_steps_and_the_validation_curve_count_optimizer_steps_in_new_and_older_logs(trained_run, tmp_path):
    """The run's metrics.csv counts the optimizer steps done (its hparams.yaml says so): 4 steps, validated after 2
    and 4. Logs of older lm, without that mark, counted one less on every row, and read back the same."""
    from lm.compare.run_results import STEPS_DONE_MARK, RunResults, read_metrics

    def steps_and_curve(run: Path) -> tuple[int, list[int]]:
        results = RunResults(path=str(run), arch="attention", lr=None, seed=None, setting={}, params=0,
                             params_without_embeddings=0, flops_per_token=0.0, batch_tokens=0)
        read_metrics(run, results)
        return results.steps, [step for step, _ in results.val_curve]

    (hparams,) = (trained_run / "logs").rglob("hparams.yaml")
    assert STEPS_DONE_MARK in hparams.read_text()
    assert steps_and_curve(trained_run) == (4, [2, 4])
    older = tmp_path / "older"
    shutil.copytree(trained_run / "logs", older / "logs")
    (hparams,) = (older / "logs").rglob("hparams.yaml")
    hparams.write_text(hparams.read_text().replace(STEPS_DONE_MARK, ""))
    (metrics,) = (older / "logs").rglob("metrics.csv")
    rows = read_csv(metrics)
    with open(metrics, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**row, "step": int(row["step"]) - 1} for row in rows)
    assert steps_and_curve(older) == (4, [2, 4])

"""`lm compare demo` end to end in its fast mode: two steps per run and per MQAR model, on the shared prepared corpus,
through the CLI as a user calls it."""

import json

from lm.cli import main
from lm.compare.demo import demo_archs
from lm.mixers import MIXERS

# A part of the default, to keep the test short: a mixer and a hybrid of two others (three mixers for the probes,
# two MQAR jobs).
ARCHS = ["attention", "hawk_mesa"]
MQAR = ["attention", "hawk", "mesa"]


def test_the_demo_compares_every_mixer_and_the_named_hybrids():
    archs = demo_archs()
    assert archs[: len(MIXERS)] == list(MIXERS) and "hawk_mesa" in archs


def test_compare_demo_fast_mode_trains_runs_probes_mqar_and_reports(kjv_data, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["compare", "demo", "--out", str(out), "--data", kjv_data, "--params", "1.5e5", "--seq_len", "32",
                 "--global_batch", "8", "--steps", "2", "--mqar_steps", "2", "--icl_steps", "2", "--eval_windows", "4",
                 "--archs", json.dumps(ARCHS)]) == 0
    printed = capsys.readouterr().out
    named = ["attention", "hawk+mesa"]  # as the report and the summary name a hybrid
    assert "in all; report:" in printed and all(f"| {arch} |" in printed for arch in named)
    assert "| hawk+mesa | 0.004 | " in (out / "summary.md").read_text()  # the hybrid's run is in its row
    assert {"mqar-1.log", "icl.log"} <= {p.name for p in (out / "logs").iterdir()}

    for arch in ARCHS:
        run = out / "runs" / arch
        assert len(list((run / "checkpoints").glob("step=*2.ckpt"))) == 1
        assert (run / "eval" / "ppl-validation-T32" / "per_position.csv").exists()
    report = (out / "report" / "report.md").read_text()
    best = report.split("## Best run per architecture")[1].split("##")[0]
    rows = [line for line in best.splitlines() if line.startswith("| ") and not line.startswith(("| arch", "| ---"))]
    assert sorted(row.split(" | ")[0][2:] for row in rows) == sorted(named)
    assert "## MQAR recall (lm eval mqar)" in report
    icl = report.split("## In-context linear regression (lm eval icl)")[1].split("##")[0]
    assert {row.split(" | ")[0][2:] for row in icl.splitlines()[4:] if row} == {*MQAR, "mesa, cg 0"}
    assert (out / "report" / "icl.png").is_file() and "](icl.png)" in report
    html = (out / "report" / "report.html").read_text()
    assert "MQAR recall" in html and "data:image/png;base64," in html

    mqar = json.loads((out / "mqar.json").read_text())
    assert [row["mixer"] for row in mqar] == MQAR and all(row["steps"] == 2 for row in mqar)
    assert all(f"| {mixer} |" in (out / "mqar.md").read_text() for mixer in MQAR)
    assert "same 512 tokens" in (out / "plan" / "plan.md").read_text()  # 2 steps x 8 x 32


def test_compare_demo_rejects_bad_input_in_one_line(tmp_path, capsys):
    assert main(["compare", "demo", "--out", str(tmp_path), "--workers", "0"]) == 2
    assert main(["compare", "demo", "--out", str(tmp_path), "--data", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--workers must be at least 1" in err[0] and "not a prepared dataset" in err[1]

"""lm.bench.train_speed at a tiny size: the figures agree with each other (no speed is asserted)."""

import json
import math
import re
from pathlib import Path

import yaml

from lm.accounting.flops import train_flops_per_token
from lm.bench.train_speed import bench_train
from lm.cli import main
from lm.model import LMConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_layers=2, n_heads=2, head_dim=32, batch=2, steps=2, warmup=1)


def json_part(printed: str) -> dict:
    return json.loads(printed[: printed.index("\n\n")])  # JSON first, then a blank line and the table


def test_bench_train_figures_are_consistent(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench_train(mixers=["attention", "mamba2"], d_model=[64], seq_len=[32, 17], **TINY,
                         peak_flops=1e12, json_out=str(out))
    rows = result["rows"]
    assert [(r["mixer"], r["seq_len"]) for r in rows] == [("attention", 32), ("attention", 17), ("mamba2", 32),
                                                          ("mamba2", 17)]
    for r in rows:
        assert r["status"] == "ok" and r["batch"] == 2 and r["d_model"] == 64
        for key in ("tokens_per_s", "model_flops_per_token", "model_flops_per_s", "mfu", "params"):
            assert r[key] > 0, key
        cfg = LMConfig(mixer=r["mixer"], d_model=64, n_layers=2, n_heads=2, head_dim=32, vocab_size=8192,
                       max_seq_len=32)
        assert math.isclose(r["model_flops_per_token"], train_flops_per_token(cfg, r["seq_len"]), rel_tol=1e-12)
        assert math.isclose(r["model_flops_per_s"], r["tokens_per_s"] * r["model_flops_per_token"])
        assert math.isclose(r["mfu"], r["model_flops_per_s"] / result["matmul_flops_per_s"])
        assert math.isclose(r["mfu_datasheet"], r["model_flops_per_s"] / 1e12)
    assert json.loads(out.read_text()) == result
    captured = capsys.readouterr()
    printed = captured.out
    assert json_part(printed) == result
    assert "| MFU (measured peak) | MFU (datasheet) |" in printed and printed.count("| attention d64 |") == 2
    # While it ran, stderr named each run as it started and counted its steps (3 a run: 1 warm-up, 2 timed).
    said = [line.strip() for line in captured.err.replace("\r", "\n").splitlines() if line.strip()]
    started = [m[1] for line in said if (m := re.match(r"lm bench train: (.+, seq_len \d+):", line))]
    assert list(dict.fromkeys(started)) == ["attention d64, seq_len 32", "attention d64, seq_len 17",
                                            "mamba2 d64, seq_len 32", "mamba2 d64, seq_len 17"], said
    assert " 12/12 " in said[-1] and said[-1].startswith("lm bench train: mamba2 d64, seq_len 17:"), said


def test_bench_train_from_run_configs_with_batch_tokens_and_budget(tmp_path):
    base = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    paths = []
    for mixer in ("deltanet", "mesa"):
        base["model"].update(mixer=mixer, d_model=32, n_layers=1, n_heads=2, head_dim=16, vocab_size=256)
        paths.append(tmp_path / f"{mixer}.yaml")
        paths[-1].write_text(yaml.safe_dump(base))
    result = bench_train(configs=[str(p) for p in paths], seq_len=[16, 40], batch_tokens=80, steps=1, warmup=0)
    assert [(r["model"], r["mixer"], r["seq_len"], r["batch"]) for r in result["rows"]] == [
        (str(paths[0]), "deltanet", 16, 5), (str(paths[0]), "deltanet", 40, 2),
        (str(paths[1]), "mesa", 16, 5), (str(paths[1]), "mesa", 40, 2)]
    assert all(r["status"] == "ok" and r["d_model"] == 32 and r["n_layers"] == 1 for r in result["rows"])
    skipped = bench_train(mixers=["attention"], d_model=[32], seq_len=[16], budget_s=0, **TINY)
    assert [r["status"] for r in skipped["rows"]] == ["skipped"] and "tokens_per_s" not in skipped["rows"][0]


def test_cli_bench_bad_config_is_one_line(tmp_path, capsys):
    # (The CLI's normal path runs in tests/test_gpu_script.py.)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_modle: 64\n")
    assert main(["bench", "train", "--configs", f"[{bad}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "d_modle" in err[0]


def test_bench_train_with_resets_reports_their_cost(capsys):
    """--resets: steps with and without resets alternate on one model; the ratio is of the same two measurements."""
    result = bench_train(mixers=["gated_deltanet"], d_model=[64], seq_len=[32], **TINY, resets=True, doc_len=8)
    row = result["rows"][0]
    assert row["status"] == "ok" and result["resets"] and result["doc_len"] == 8
    assert math.isclose(row["reset_ratio"], row["reset_tokens_per_s"] / row["tokens_per_s"])
    assert "with / without" in capsys.readouterr().out

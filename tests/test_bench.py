"""bench.train_speed at a tiny size: the figures agree with each other (no speed is asserted)."""

import json
import math
import subprocess
import sys
from pathlib import Path

from bench.train_speed import bench_train

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(d_model=64, n_layers=2, n_heads=2, head_dim=32, seq_len=32, batch=2, steps=2, warmup=1)


def test_bench_train_figures_are_consistent(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench_train(**TINY, json_out=str(out))
    for key in ("tokens_per_s", "model_flops_per_token", "model_flops_per_s", "matmul_flops_per_s", "mfu", "params"):
        assert result[key] > 0, key
    assert math.isclose(result["model_flops_per_s"], result["tokens_per_s"] * result["model_flops_per_token"])
    assert math.isclose(result["mfu"], result["model_flops_per_s"] / result["matmul_flops_per_s"])
    assert (result["d_model"], result["n_layers"], result["seq_len"], result["batch"]) == (64, 2, 32, 2)
    assert json.loads(out.read_text()) == result
    printed = capsys.readouterr().out
    assert json.loads(printed[: printed.index("\n|")]) == result  # JSON first, then the markdown row
    assert "| MFU |" in printed


def test_cli_bench_prints_json():
    args = [str(a) for k, v in TINY.items() for a in (f"--{k}", v)]
    proc = subprocess.run([sys.executable, "-m", "lm.cli", "bench", "train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout[: proc.stdout.index("\n|")])
    assert result["tokens_per_s"] > 0

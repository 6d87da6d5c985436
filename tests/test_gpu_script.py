"""bench/gpu.sh, the one script for a lent GPU machine, run here at tiny sizes on the CPU (SMOKE=1): it must get
through its steps and leave the figures where docs/performance.md says."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_smoke(tmp_path):
    env = dict(os.environ, SMOKE="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "torch " in (tmp_path / "env.txt").read_text()
    assert "pytest exit status 0" in (tmp_path / "gpu-tests.txt").read_text()
    rows = json.loads((tmp_path / "gpu-train.json").read_text())["rows"]
    assert [(r["mixer"], r["seq_len"], r["status"]) for r in rows] == [
        ("attention", 16, "ok"), ("attention", 40, "ok"), ("gated_deltanet", 16, "ok"), ("gated_deltanet", 40, "ok")]
    assert all(r["mfu_datasheet"] > 0 for r in rows)
    assert "| MFU (datasheet) |" in (tmp_path / "gpu-train.md").read_text()

"""bench/gpu.sh, the one script for a lent GPU machine: at tiny sizes on the CPU (SMOKE=1) it must get through its
steps and leave the figures where docs/performance.md says; without SMOKE it must stop at once, with a failure, when
its wheels are missing or do not install (it may never look green by skipping)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_script(out: Path, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_gpu_script_smoke(tmp_path):
    proc = gpu_script(tmp_path, SMOKE="1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "torch " in (tmp_path / "env.txt").read_text()
    assert "5 skipped" in (tmp_path / "gpu-tests.txt").read_text()  # each GPU test file, skipped on a CPU
    rows = json.loads((tmp_path / "gpu-train.json").read_text())["rows"]
    assert [(r["mixer"], r["seq_len"], r["status"]) for r in rows] == [
        ("attention", 16, "ok"), ("attention", 40, "ok"), ("gated_deltanet", 16, "ok"), ("gated_deltanet", 40, "ok"),
        ("mesa", 16, "ok")]
    assert rows[-1]["model"].endswith("mesa-1b-cg_tol.yaml")  # Mesa with cg_tol 1e-4
    mesa = json.loads((tmp_path / "mesa-peer.json").read_text())["mesa_op"]
    assert mesa["rows"][0]["lm_error"] < 1e-5 and "| lm speed / fla |" in (tmp_path / "mesa-peer.md").read_text()
    assert all(r["mfu_datasheet"] > 0 and r["first_step_s"] > 0 for r in rows)
    assert "| MFU (datasheet) |" in (tmp_path / "gpu-train.md").read_text()
    assert (tmp_path / "summary.txt").read_text().splitlines()[-1] == "all passed"


def test_gpu_script_fails_without_its_wheels(tmp_path):
    (tmp_path / "wheels").mkdir()
    proc = gpu_script(tmp_path / "none", WHEELS=str(tmp_path / "wheels"))
    assert proc.returncode == 1 and "FAIL no wheels" in proc.stdout
    (tmp_path / "wheels" / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    proc = gpu_script(tmp_path / "broken", WHEELS=str(tmp_path / "wheels"))
    assert proc.returncode == 1 and "FAIL wheel install" in proc.stdout
    assert not (tmp_path / "broken" / "gpu-tests.txt").exists()  # it stopped before the tests


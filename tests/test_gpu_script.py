"""bench/gpu.sh, the one script for a lent GPU machine: at tiny sizes on the CPU (SMOKE=1) it must get through its
steps and leave the figures where docs/performance.md says; without SMOKE it must stop at once, with a failure, when
its wheels are missing or do not install (it may never look green by skipping)."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_script(out: Path, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Both calls at tiny sizes, run at once (each spends much of its time starting Python processes one by one):
    {call: (its output folder, the finished script)}."""
    outs = {call: tmp_path_factory.mktemp(f"gpu-call{call}") for call in ("1", "2")}
    # The GPU test files' CPU tests (tests/test_flex_attention.py's, a compiled CPU kernel among them: a minute) are
    # the suite's own: here only the CUDA ones run, to their skips. Every file is still collected (an import error
    # fails the step) and a GPU-only test that ran on the CPU would still fail it.
    only_cuda = " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS"), "-k cuda"]))
    with ThreadPoolExecutor(2) as pool:
        runs = {call: pool.submit(gpu_script, out, SMOKE="1", CALL=call, PYTEST_ADDOPTS=only_cuda)
                for call, out in outs.items()}
        return {call: (outs[call], run.result()) for call, run in runs.items()}


def test_gpu_script_smoke(smoke):
    tmp_path, proc = smoke["1"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "torch " in (tmp_path / "env.txt").read_text()
    tests = (tmp_path / "gpu-tests.txt").read_text()
    assert "9 skipped" in tests and " deselected" in tests  # the GPU test files and the CUDA flex tests skipped; the
    # CPU flex tests left to the suite
    rows = json.loads((tmp_path / "gpu-train.json").read_text())["rows"]
    assert [(r["mixer"], r["seq_len"], r["status"]) for r in rows] == [
        ("attention", 16, "ok"), ("attention", 40, "ok"), ("gated_deltanet", 16, "ok"), ("gated_deltanet", 40, "ok"),
        ("mesa", 16, "ok")]
    assert rows[-1]["model"].endswith("mesa-1b-cg_tol.yaml")  # Mesa with cg_tol 1e-4
    mesa = json.loads((tmp_path / "mesa-peer.json").read_text())["mesa_op"]
    assert mesa["rows"][0]["lm_error"] < 1e-5 and "| lm speed / fla |" in (tmp_path / "mesa-peer.md").read_text()
    assert all(r["mfu_datasheet"] > 0 and r["first_step_s"] > 0 for r in rows)
    assert "| MFU (datasheet) |" in (tmp_path / "gpu-train.md").read_text()
    # Context parallelism (on the CPU: gloo), whose memory per rank falls with the window split over two
    context = json.loads((tmp_path / "context.json").read_text())["rows"]
    assert [(r["mixer"], r["N"], r["tokens_per_rank"]) for r in context] == [("gated_deltanet", 1, 64),
                                                                             ("gated_deltanet", 2, 32)]
    assert context[1]["memory_vs_fewest"] < 0.9 and len(context[1]["peak_mib_per_rank"]) == 2
    assert (tmp_path / "summary.txt").read_text().splitlines()[-1] == "all passed"


def test_gpu_script_second_call_smoke(smoke):
    """CALL=2: no tests and no Mesa peer; the 1B rows at the long length, then trainer.compile per mixer."""
    tmp_path, proc = smoke["2"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not (tmp_path / "gpu-tests.txt").exists() and not (tmp_path / "mesa-peer.json").exists()
    rows = json.loads((tmp_path / "gpu-train.json").read_text())["rows"]
    assert [(r["mixer"], r["seq_len"], r["status"]) for r in rows] == [("attention", 24, "ok"),
                                                                      ("gated_deltanet", 24, "ok")]
    compiled = json.loads((tmp_path / "compile.json").read_text())["rows"]
    assert [(r["mixer"], r["status"]) for r in compiled] == [("attention", "ok")]
    assert not (tmp_path / "context.json").exists()  # CALL=1's
    assert (tmp_path / "summary.txt").read_text().splitlines()[-1] == "all passed"


def test_gpu_script_fails_without_its_wheels(tmp_path):
    (tmp_path / "wheels").mkdir()
    proc = gpu_script(tmp_path / "none", WHEELS=str(tmp_path / "wheels"))
    assert proc.returncode == 1 and "FAIL no wheels" in proc.stdout
    (tmp_path / "wheels" / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    proc = gpu_script(tmp_path / "broken", WHEELS=str(tmp_path / "wheels"))
    assert proc.returncode == 1 and "FAIL wheel install" in proc.stdout
    assert not (tmp_path / "broken" / "gpu-tests.txt").exists()  # it stopped before the tests


def test_gpu_script_puts_a_packed_triton_first(tmp_path):
    """`make gpu-triton`'s tarball goes on the path ahead of the machine's Triton, which lends it its ptxas."""
    import base64
    import hashlib
    import io
    import tarfile
    import zipfile

    def metadata(name, version):
        return f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    files = {"tiny/__init__.py": b"", "tiny-1.0.dist-info/METADATA": metadata("tiny", "1.0"),
             "tiny-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}\n" for name, data in files.items()]
    files["tiny-1.0.dist-info/RECORD"] = "".join(record + ["tiny-1.0.dist-info/RECORD,,\n"]).encode()
    with zipfile.ZipFile(wheels / "tiny-1.0-py3-none-any.whl", "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
    with tarfile.open(wheels / "triton-9.9.9-minimal.tar.xz", "w:xz") as tar:
        for name, data in {"triton/__init__.py": b'__version__ = "9.9.9"\n',
                           "triton-9.9.9.dist-info/METADATA": metadata("triton", "9.9.9")}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    proc = gpu_script(tmp_path / "out", WHEELS=str(wheels), LM_SITE=str(tmp_path / "site"))
    assert proc.returncode == 1 and "FAIL a kernel package or CUDA is missing" in proc.stdout  # no CUDA here
    env = (tmp_path / "out" / "env.txt").read_text()
    assert "triton 9.9.9" in env and f"triton imported 9.9.9 from {tmp_path / 'site' / 'triton'} ptxas /" in env, env
    assert (tmp_path / "site" / "tiny").is_dir()

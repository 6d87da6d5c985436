"""The wheel's file list, in seconds: one installed namespace (lm/, its dist-info and lm_startup.pth at the top level),
and every asset of pyproject.toml's force-include under lm/_shipped/. tests/wheel_check.sh (`make wheel-check`, run by
CI) installs the wheel into a fresh environment and uses it; this test only builds it, with this environment's
hatchling (no download), and skips where there is none."""

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What must ship whatever pyproject.toml says (the force-include table is also read, below).
ASSETS = ["configs/demo.yaml", "configs/hawk_mesa/145m.yaml", "eval/suites/standard.yaml",
          "eval/tasks/based_recall/utils.py", "eval/tasks/kjv_cloze/kjv_cloze.yaml",
          "eval/tasks/kjv_cloze/kjv_cloze.jsonl", "eval/tasks/kjv_cloze/utils.py", "slurm/templates/job.sbatch.j2",
          "slurm/site.example.yaml", "data_prep/corpus/kjv.jsonl.gz", "configs/data/slimpajama.yaml",
          "configs/ladder/cpu.yaml"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> list[str]:
    if importlib.util.find_spec("hatchling") is None:
        pytest.skip(f"hatchling is not installed in {sys.prefix}, and this test builds without isolation (no "
                    f"download); tests/wheel_check.sh builds the wheel with pip's isolated build")
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(out), str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("lm-*.whl")
    return zipfile.ZipFile(path).namelist()


def files_under(path: Path) -> list[str]:
    """The files a force-included path holds, relative to the checkout, as the wheel ships them (no bytecode)."""
    if path.is_file():
        return [path.relative_to(ROOT).as_posix()]
    return sorted(p.relative_to(ROOT).as_posix() for p in path.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def test_the_wheel_installs_lm_alone(wheel):
    top = {name.split("/")[0] + ("/" if "/" in name else "") for name in wheel}
    extra = {t for t in top if t not in ("lm/", "lm_startup.pth") and not (t.startswith("lm-") and
                                                                       t.endswith(".dist-info/"))}
    assert not extra, f"top-level entries besides lm/, lm-*.dist-info/ and lm_startup.pth: {sorted(extra)}"
    assert {"lm/", "lm_startup.pth"} <= top
    assert "lm/__init__.py" in wheel and "lm/eval/harness.py" in wheel and "lm/bench/__init__.py" in wheel
    assert not [n for n in wheel if "__pycache__/" in n or n.endswith(".pyc")]


def test_the_shipped_assets_are_under_lm_shipped(wheel):
    names = set(wheel)
    missing = [a for a in ASSETS if f"lm/_shipped/{a}" not in names]
    assert not missing, f"not shipped under lm/_shipped/: {missing}"
    # Every file of every force-included path, at the same relative place.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        force = tomllib.load(f)["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    for source, target in force.items():
        assert target == f"lm/_shipped/{source}", f"{source} ships at {target}, not lm/_shipped/{source}"
        missing = [p for p in files_under(ROOT / source) if f"lm/_shipped/{p}" not in names]
        assert not missing, f"{source}: not in the wheel: {missing[:10]}"

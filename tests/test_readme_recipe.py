"""README.md's "Train on your own text" recipe, run as it is written: its bash block, on a folder of .txt files, with
only its own STEPS setting made small. Each of its steps must have done its part: data, a trained checkpoint, an
evaluation, a sample."""

import gzip
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from lm.data_prep.prepare import BUNDLED_CORPUS

ROOT = Path(__file__).resolve().parents[1]
MARKER = "# recipe: own-text"
STEPS = 10


def recipe(readme: Path = ROOT / "README.md") -> str:
    """The fenced bash block of README.md whose first line is the marker."""
    blocks = re.findall(r"^```bash\n(.*?)^```$", readme.read_text(), re.MULTILINE | re.DOTALL)
    (block,) = [b for b in blocks if b.startswith(MARKER + "\n")]
    return block


def write_texts(folder: Path, documents: int = 100) -> None:
    """The first chapters of the bundled corpus, one .txt file each (about 440 KB)."""
    folder.mkdir()
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        for i, line in zip(range(documents), f):
            (folder / f"{i:03d}.txt").write_text(json.loads(line)["text"])


def test_the_own_text_recipe_runs_as_written(tmp_path):
    script = recipe()
    assert "${STEPS:-" in script and "${TEXT:-my_texts}" in script  # the settings the test relies on
    write_texts(tmp_path / "my_texts")  # the recipe's default TEXT
    env = {**os.environ, "STEPS": str(STEPS), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for name in ("TEXT", "RUN", "VOCAB", "SEQ", "PROMPT"):
        env.pop(name, None)  # the recipe's defaults, as a reader gets them
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run = tmp_path / "runs" / "mine"
    manifest = json.loads((run / "data" / "manifest.json").read_text())  # lm prepare
    assert 257 <= manifest["tokenizer"]["vocab_size"] <= 4096
    assert (run / "checkpoints" / f"step={STEPS:08d}.ckpt").is_file()  # lm train
    assert f"step {STEPS}/{STEPS} | loss " in done.stdout
    ppl = json.loads((run / "eval" / "ppl-validation-T256" / "ppl.json").read_text())["ppl"]  # lm eval ppl
    assert math.isfinite(ppl) and ppl < 4096  # better than a uniform guess after 10 steps
    sample = done.stdout.rstrip().splitlines()[-1]  # lm generate
    assert sample.startswith("The") and len(sample) > len("The"), sample

"""README.md's "Train on your own text" recipe, run as it is written: its bash block, on a folder of .txt files, with
only its own STEPS setting made small. Each of its steps must have done its part: data, a trained checkpoint, an
evaluation, a sample."""

import gzip
import json
import math
import os
import re
import shlex
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


def recipe_defaults(script: str) -> dict[str, str]:
    """The settings of the recipe's first lines, NAME=${NAME:-default}, at their defaults."""
    return dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", script, re.MULTILINE))


def recipe_command(script: str, command: str) -> list[str]:
    """The recipe's `lm COMMAND ...` line with its settings at their defaults, as the words after `lm`."""
    (line,) = [line for line in script.splitlines() if line.startswith(f"lm {command} ")]
    defaults = recipe_defaults(script)
    return shlex.split(re.sub(r"\$(\w+)", lambda m: defaults[m.group(1)], line))[1:]


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


def test_the_recipes_prepare_holds_out_at_least_64_windows_of_its_length(tmp_path, monkeypatch, capsys):
    """The recipe's `lm prepare` line as written, through the command line in this process, on 100 documents of
    about 1,000 tokens: 1% of them would be 3 windows of SEQ + 1; validation holds 64, as lm train cuts them."""
    from lm.cli import main
    from lm.training.data import TokenStream, count_windows

    script = recipe()
    seq_len = int(recipe_defaults(script)["SEQ"])
    write_texts(tmp_path / "my_texts")
    monkeypatch.chdir(tmp_path)
    assert main(recipe_command(script, "prepare")) == 0
    validation = TokenStream(str(tmp_path / "runs" / "mine" / "data"), "validation")
    assert count_windows(validation.total, seq_len) >= 64
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prepared ")]
    assert len(said) == 1 and f"windows of --seq_len {seq_len}" in said[0]

"""Every `lm` command README.md shows parses as written: its command exists and the command's parser takes its
options (a misspelt option or a renamed command fails here). Parsed, not run: the commands that train or submit are
run by the tests of their features, and the "Train on your own text" recipe as a whole by tests/test_readme_recipe.py.
The files a command reads are the repo's, or configs/demo.yaml where the README names a placeholder (C.yaml)."""

import re
import shlex
from pathlib import Path

import pytest

from lm.compare.report import report_parser
from lm.slurm.submit import split_argv, submit_parser
from lm.training.config import parse_run_config
from lm.util.commands import OWN_ARGV, POSITIONAL, find_command, function_parser, load_command

ROOT = Path(__file__).resolve().parents[1]
SHELL_VALUES = {"RUN": "runs/mine", "TEXT": "my_texts", "VOCAB": "4096", "SEQ": "256", "STEPS": "1000",
                "PROMPT": "The"}


def readme_commands(readme: Path = ROOT / "README.md") -> list[str]:
    """Each `lm ...` command line of README.md's bash blocks, continuation lines joined, shell values filled in."""
    blocks = re.findall(r"^```bash\n(.*?)^```", readme.read_text(), flags=re.S | re.M)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    filled = [re.sub(r"\$\{(\w+):-[^}]*\}|\$(\w+)", lambda m: SHELL_VALUES[m[1] or m[2]], line) for line in lines]
    return [line for line in filled if line.startswith("lm ")]


def parse(argv: list[str]) -> None:
    name, rest = find_command(argv)
    rest = [arg.replace("C.yaml", "configs/demo.yaml") for arg in rest]
    if name == "train":
        if "--config" in rest and not (ROOT / rest[rest.index("--config") + 1]).exists():
            return  # the recipe's own config, written by its heredoc: tests/test_readme_recipe.py runs it
        parse_run_config(rest)
    elif name == "slurm submit":
        own, command = split_argv(rest)
        namespace = submit_parser().parse_args(own)
        if namespace.kind == "train" and not namespace.array:
            parse_run_config(command)
    elif name == "compare report":
        report_parser().parse_args(rest)
    else:
        assert name not in OWN_ARGV
        function_parser(load_command(name), f"lm {name}", name in POSITIONAL).parse_args(rest)


def test_the_readme_shows_commands_of_every_group():
    words = {shlex.split(line, comments=True)[1] for line in readme_commands()}
    assert {"prepare", "train", "eval", "export", "generate", "compare", "slurm", "bench", "research"} <= words


@pytest.mark.parametrize("line", readme_commands())
def test_readme_command_parses_as_written(line, monkeypatch):
    monkeypatch.chdir(ROOT)
    words = shlex.split(line, comments=True)[1:]
    shell = [i for i, word in enumerate(words) if word in (">", "|", "&&")]  # a redirection or pipe ends the command
    try:
        parse(words[:shell[0]] if shell else words)
    except SystemExit as exit:  # --print_config prints the resolved config and exits 0
        assert exit.code == 0, line

"""The command table (lm/util/commands.py) and the help generated from it: every command listed once under its group,
every entry loads, `lm GROUP` lists a group, and a command that moved is an unknown one with a pointer."""

import ast
import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

from lm.cli import main
from lm.util.commands import COMMANDS, GROUPS, OWN_ARGV, POSITIONAL, usage


def listed(text: str) -> list[str]:
    """The command names of a help text's listing lines ("  NAME  summary")."""
    names = sorted(COMMANDS, key=len, reverse=True)  # "eval mqar-grid" before "eval mqar"
    found = []
    for line in text.splitlines():
        found += [name for name in names if re.match(rf"  {re.escape(name)}  ", line)][:1]
    return found


def test_help_lists_every_command_once_under_its_groups_heading(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    found = listed(text)
    assert sorted(found) == sorted(COMMANDS), set(COMMANDS) ^ set(found)
    assert all(len(line) <= 120 for line in text.splitlines()), max(text.splitlines(), key=len)
    sections = text.split("\n\n")[1:]  # after the usage line, one section per group
    assert [section.splitlines()[0] for section in sections] == [f"{heading}:" for heading in GROUPS.values()]
    for group, section in zip(GROUPS, sections):
        assert listed(section) == [name for name, command in COMMANDS.items() if command.group == group]


def test_every_entry_loads_to_a_function_of_lm():
    for name, command in COMMANDS.items():
        module, function = command.target.split(":")
        fn = getattr(importlib.import_module(module), function)
        assert callable(fn) and fn.__module__.startswith("lm."), (name, fn)
        assert command.group in GROUPS and command.summary and "\n" not in command.summary, name
        assert " " not in name or name.split()[0] == command.group, name  # `lm eval ...` is in the group eval
    assert OWN_ARGV | POSITIONAL <= set(COMMANDS)


def first_paragraphs() -> set[str]:
    """The first paragraph of every docstring under lm/, on one line: what a help text summarises."""
    paragraphs = set()
    for path in (Path(__file__).resolve().parents[1] / "lm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node):
                paragraphs.add(" ".join(ast.get_docstring(node).split("\n\n")[0].split()))
    return paragraphs


def summaries(text: str) -> list[str]:
    """A --help text's description and its groups' titles, each on one line (argparse wraps a description and ends a
    title with ':'; a word broken after its hyphen is joined again)."""
    blocks = re.sub(r"(\w-)\n *", r"\1", text).split("\n\n")[1:]  # after the usage
    found = []
    for block in blocks:
        lines = block.splitlines()
        if len(lines) > 1 and lines[1].startswith("  "):  # a group: its title, then its options
            found.append(lines[0].removesuffix(":"))
        elif not block.startswith(" "):
            found.append(" ".join(block.split()))
    return found


def test_every_commands_help_summarises_in_whole_paragraphs():
    """No description or group title in any command's --help stops where its docstring's first line wraps (as
    "Defaults come from the site file ($LM_SLURM_SITE, else:" did)."""
    paragraphs = first_paragraphs()
    for name in COMMANDS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*name.split(), "--help"])
        texts = summaries(out.getvalue())
        assert texts and "options" in texts, (name, out.getvalue()[:2000])
        for text in texts:
            cut = [p for p in paragraphs if p.rstrip(".") != text.rstrip(".") and p.startswith(text.rstrip("."))]
            assert not cut, f"lm {name} --help cuts short: {text!r} of {cut[0]!r}"


def test_research_ab_has_its_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["research", "ab", "--help"])
    assert exit_info.value.code == 0
    assert "--rev" in capsys.readouterr().out


def test_a_moved_command_is_unknown_in_one_line_that_points_to_it(capsys):
    assert main(["bench", "ab"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'bench ab'" in err[0] and "lm research ab" in err[0], err
    assert captured.out == ""
    assert main(["nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'nope'" in err[0] and "research" in err[0], err


@pytest.mark.parametrize("group", ["eval", "compare", "slurm", "bench", "research"])
def test_a_group_alone_lists_its_commands(group, capsys):
    members = [name for name in COMMANDS if name.startswith(group + " ")]
    assert main([group]) == 0  # the group alone: its listing, and nothing on stderr
    captured = capsys.readouterr()
    assert listed(captured.out) == members and captured.err == ""
    assert captured.out.strip() == usage(group)
    assert main([group, "--help"]) == 0
    assert listed(capsys.readouterr().out) == members


def test_eval_tasks_names_the_shipped_tasks_and_their_folder_for_lm_eval(capsys):
    from lm_eval.tasks import TaskManager

    from lm.util.resources import shipped

    assert main(["eval", "tasks", "--path", "true"]) == 0
    folder = capsys.readouterr().out.strip()
    assert folder == str(shipped("eval/tasks"))  # a checkout's eval/tasks, or the wheel's lm/_shipped/eval/tasks
    assert main(["eval", "tasks"]) == 0
    listing = capsys.readouterr().out
    assert folder in listing.splitlines()[0] and '--include_path "$(lm eval tasks --path true)"' in listing
    named = {line.split()[0] for line in listing.splitlines()[1:] if line.startswith("  ") and "lm_eval" not in line}
    assert {"kjv_cloze", "based_drop", "based_triviaqa"} <= named
    # What lm-eval itself finds at that folder, as `lm_eval --include_path FOLDER` does.
    assert named == set(TaskManager(include_path=folder, include_defaults=False).all_tasks)

"""`lm mixers` (lm/cli/mixers.py): every registered mixer on a line of its own, a mixer's options with their types,
defaults, units and meaning read from its Options docstring, every option documented, and docs/mixers.md's generated
block the same as what the code gives."""

import dataclasses
import difflib
from pathlib import Path

import pytest

from lm.cli import main
from lm.cli.mixers import BEGIN, END, doc_block, entries, mixer_summary, undocumented, write_doc
from lm.mixers import MIXERS
from lm.util.errors import UserError

DOC = Path(__file__).resolve().parents[1] / "docs" / "mixers.md"
REGENERATE = "python -m lm.cli.mixers docs/mixers.md"


def option_rows(text: str) -> dict[str, dict[str, str]]:
    """`lm mixers NAME`'s table: option -> {type, default, units, meaning}, cut at the header's column starts."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["option", "type"])
    header = lines[at]
    columns = ["option", "type", "default", "units", "meaning"]
    starts = [header.index(column) for column in columns] + [None]
    rows = {}
    for line in lines[at + 1:]:
        if not line.startswith("  "):
            break
        cells = [line[start:end].strip() for start, end in zip(starts, starts[1:])]
        rows[cells[0]] = dict(zip(columns[1:], cells[1:]))
    return rows


def test_lm_mixers_lists_every_mixer_once_on_a_line_of_its_own(capsys):
    assert main(["mixers"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in MIXERS:
        mine = [line for line in lines if line.split()[:1] == [name]]
        assert len(mine) == 1 and mixer_summary(name) in mine[0], (name, lines)


def test_lm_mixers_kda_prints_every_option_with_its_type_default_units_and_meaning(capsys):
    assert main(["mixers", "kda"]) == 0
    rows = option_rows(capsys.readouterr().out)
    assert list(rows) == [field.name for field in dataclasses.fields(MIXERS["kda"].Options)]
    assert rows["beta_range"]["type"] == "list[float]" and rows["beta_range"]["default"] == "[0.0, 1.0]"
    assert rows["conv_size"] == {"type": "int", "default": "4", "units": "tokens",
                                 "meaning": "width of the short causal convs + SiLU on q, k and v; 0: none"}
    assert rows["expand_v"]["units"] == "x head_dim" and rows["channel_gates"]["units"] == ""
    assert "erase gate" in rows["channel_gates"]["meaning"]
    assert all(row["meaning"] for row in rows.values()), rows


def test_a_default_that_other_mixers_do_not_share_is_pointed_out(capsys):
    """gated_deltaproduct's beta_range is [0, 2] where the other delta-rule mixers' is [0, 1]: its row says what
    [0, 2] allows, and the lines after the table name the mixers that differ."""
    assert main(["mixers", "gated_deltaproduct"]) == 0
    out = capsys.readouterr().out
    beta = option_rows(out)["beta_range"]
    assert beta["default"] == "[0.0, 2.0]" and "negative eigenvalues" in beta["meaning"]
    differ = out.split("defaults that other mixers do not share:\n")[1].splitlines()
    assert "  beta_range: [0.0, 2.0] here; [0.0, 1.0] in deltanet, gated_deltanet, kda, precond_gated_deltanet" \
        in differ, differ
    assert main(["mixers", "deltanet"]) == 0
    assert "  beta_range: [0.0, 1.0] here; [0.0, 2.0] in gated_deltaproduct" in capsys.readouterr().out
    assert main(["mixers", "swa"]) == 0
    assert "defaults that other mixers do not share" not in capsys.readouterr().out  # attention's are its own


def test_an_unknown_mixer_is_one_line_exit_2_naming_the_known_ones(capsys):
    assert main(["mixers", "kdaa"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1, captured
    assert err[0].startswith("lm mixers: error: unknown mixer 'kdaa' (did you mean 'kda'?); known: ")
    assert all(name in err[0] for name in MIXERS), err


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_every_option_has_a_documented_meaning(name):
    """Each Options field has an entry in its docstring's Attributes (or its parent's), with a meaning; no entry names
    a field that does not exist; the Options says in its first line what the mixer is."""
    options = MIXERS[name].Options
    fields = {field.name for field in dataclasses.fields(options)}
    assert not undocumented(name), f"{name}: no `Attributes:` entry in {options.__qualname__}'s docstring for " \
        f"{undocumented(name)}"
    assert set(entries(options)) <= fields, f"{name}: entries for no field: {set(entries(options)) - fields}"
    assert mixer_summary(name), f"{name}: {options.__qualname__} has no docstring"


def test_docs_mixers_md_is_what_lm_mixers_gives(capsys):
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"docs/mixers.md has lost its markers: {BEGIN}"
    written = BEGIN + text.split(BEGIN)[1].split(END)[0] + END + "\n"
    expected = doc_block(list(MIXERS))
    diff = "\n".join(difflib.unified_diff(written.splitlines(), expected.splitlines(), "docs/mixers.md",
                                          "lm mixers --markdown true", lineterm="", n=0))
    assert written == expected, f"docs/mixers.md differs from `lm mixers`; regenerate it: {REGENERATE}\n{diff[:3000]}"
    assert main(["mixers", "--markdown", "true"]) == 0
    assert capsys.readouterr().out == expected


def test_the_block_is_rewritten_in_place_and_the_rest_kept(tmp_path):
    page = tmp_path / "mixers.md"
    page.write_text(f"# Mixers\n\nbefore\n\n{BEGIN}\nstale\n{END}\n\nafter\n")
    write_doc(page)
    assert page.read_text() == f"# Mixers\n\nbefore\n\n{doc_block(list(MIXERS))}\nafter\n"
    page.write_text("no markers\n")
    with pytest.raises(UserError, match="has no generated block"):
        write_doc(page)

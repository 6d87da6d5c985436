"""The local long-context probes: needles land at the asked depth, examples are deterministic per seed and fit
their length, and `lm eval longctx` writes its grid (CSV + heatmaps) for a model."""

import csv
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from lm.eval.longctx.grid import longctx
from lm.eval.longctx.probes import INTRO, PROBES, make_example, score
from lm.export import save_pretrained
from lm.model import LanguageModel, LMConfig
from lm.util.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(kjv_data) -> Tokenizer:
    return Tokenizer.from_file(str(Path(kjv_data) / "tokenizer.json"))


def tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("haystack, tolerance", [("noise", 0.02), ("corpus", 0.05)])
@pytest.mark.parametrize("probe", ["single", "multikey", "multivalue"])
def test_the_needle_lands_at_the_asked_depth(tokenizer, probe, haystack, tolerance):
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        example = make_example(probe, tokenizer, 2048, depth, seed=0, haystack_kind=haystack)
        assert abs(example.needle_depth - depth) <= tolerance
        # Measured independently: where the first answer's needle sentence sits among the prompt's tokens.
        body = example.prompt[len(INTRO):example.prompt.rindex("\nWhat")]  # the haystack with its needles
        needle = body.rindex("One of the special magic numbers", 0, body.index(example.answers[0]))
        before = tokens(tokenizer, body[:needle])
        assert abs(before / tokens(tokenizer, body) - depth) <= tolerance + 0.02


@pytest.mark.parametrize("probe", PROBES)
def test_examples_are_deterministic_fit_their_length_and_hold_their_answers(tokenizer, probe):
    a, b = (make_example(probe, tokenizer, 1024, 0.5, seed=7) for _ in range(2))
    assert a == b
    assert make_example(probe, tokenizer, 1024, 0.5, seed=8).prompt != a.prompt
    assert 0.9 * 1024 <= tokens(tokenizer, a.prompt) + 1 <= 1024
    assert all(answer in a.prompt for answer in a.answers)
    assert len(a.answers) == {"passkey": 1, "single": 1, "multikey": 1, "mqar": 2}.get(probe, 4)
    assert score(" ".join(a.answers), a.answers) == 1 and score("nothing", a.answers) == 0


def test_variable_tracking_chains_from_the_value(tokenizer):
    example = make_example("vt", tokenizer, 1024, 0.0, seed=1)
    first, *rest = example.answers
    value = example.prompt.split(f"VAR {first} = ")[1].split(".")[0]
    assert value.isdigit() and f"value {value}" in example.prompt
    for a, b in zip(example.answers, rest):
        assert example.prompt.index(f"VAR {b} = VAR {a}.") > example.prompt.index(f"VAR {a} =")


def test_bad_probe_settings_are_user_errors(tokenizer):
    with pytest.raises(UserError, match="probe 'needle'"):
        make_example("needle", tokenizer, 1024, 0.5, 0)
    with pytest.raises(UserError, match="depth must lie in"):
        make_example("single", tokenizer, 1024, 1.5, 0)
    with pytest.raises(UserError, match="leaves no room"):
        make_example("single", tokenizer, 64, 0.5, 0)


def test_longctx_writes_the_grid_and_heatmaps(kjv_data, tmp_path, capsys):
    torch.manual_seed(0)
    config = LMConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, head_dim=16, max_seq_len=64,
                      mixer="gated_deltanet")
    save_pretrained(LanguageModel(config).state_dict(), config, tmp_path / "model",
                    Path(kjv_data) / "tokenizer.json")
    rows = longctx(str(tmp_path / "model"), probes=["single", "vt"], lengths=[400, 600], depths=[0.0, 1.0],
                   samples=2, max_new_tokens=4, out=str(tmp_path / "out"))
    assert len(rows) == 2 * 2 * 2 and all(0 <= r["accuracy"] <= 1 for r in rows)
    assert f"lm eval longctx: wrote grid.csv, each probe's grid PNG and outputs in {tmp_path / 'out'}" in \
        capsys.readouterr().err  # where, on stderr
    with open(tmp_path / "out" / "grid.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["probe"], r["length"], r["depth"]) for r in table][:2] == [("single", "400", "0.0"),
                                                                           ("single", "400", "1.0")]
    for probe in ("single", "vt"):
        assert (tmp_path / "out" / f"grid-{probe}.png").stat().st_size > 1000
        assert len((tmp_path / "out" / f"{probe}-outputs.jsonl").read_text().splitlines()) == 2 * 2 * 2


def test_the_probes_as_lm_eval_tasks_give_the_same_generations_and_scores(kjv_data, tmp_path):
    import json

    import lm_eval
    from lm_eval.tasks import TaskManager

    from lm.eval.harness import LMHarness

    torch.manual_seed(0)
    config = LMConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, head_dim=16, max_seq_len=64)
    save_pretrained(LanguageModel(config).state_dict(), config, tmp_path / "model",
                    Path(kjv_data) / "tokenizer.json")
    out = tmp_path / "out"
    assert longctx(str(tmp_path / "model"), probes=["passkey", "mqar"], lengths=[300], depths=[0.5], samples=3,
                   max_new_tokens=6, out=str(out), tasks_only=True) == []
    assert not (out / "grid.csv").exists()
    rows = longctx(str(tmp_path / "model"), probes=["passkey", "mqar"], lengths=[300], depths=[0.5], samples=3,
                   max_new_tokens=6, out=str(out))
    evaluated = lm_eval.simple_evaluate(
        model=LMHarness(checkpoint=str(tmp_path / "model")), tasks=["longctx_passkey", "longctx_mqar"],
        task_manager=TaskManager(include_path=str(out / "lm_eval"), include_defaults=False), log_samples=True,
        bootstrap_iters=0)
    for probe, row in zip(["passkey", "mqar"], rows):
        ours = [json.loads(line) for line in (out / f"{probe}-outputs.jsonl").read_text().splitlines()]
        theirs = sorted(evaluated["samples"][f"longctx_{probe}"], key=lambda s: s["doc_id"])
        assert [s["resps"][0][0] for s in theirs] == [o["output"] for o in ours]
        assert evaluated["results"][f"longctx_{probe}"]["accuracy,none"] == pytest.approx(row["accuracy"])


def test_passkey_training_saves_a_model_and_grids_it(kjv_data, tmp_path):
    """The path of `lm eval passkey` in a few steps (the slow test below checks that it learns)."""
    from lm.eval.longctx.passkey import PasskeyBatches, passkey

    tokenizer = Tokenizer.from_file(str(Path(kjv_data) / "tokenizer.json"))
    inputs, targets = next(iter(PasskeyBatches(tokenizer, 200, 2, seed=0)))
    # Targets on the answer only: " " and a five-digit key, whose tokens follow the input's last real token.
    key_tokens = len(tokenizer.encode(" 12345", add_special_tokens=False).ids)
    assert inputs.shape == targets.shape and int((targets != -100).sum()) == 2 * key_tokens
    rows = passkey(kjv_data, str(tmp_path), length=200, steps=3, batch_size=2, eval_lengths=[200, 300],
                   depths=[0.0, 1.0], samples=2)
    assert [(r["length"], r["depth"]) for r in rows] == [(200, 0.0), (200, 1.0), (300, 0.0), (300, 1.0)]
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert (tmp_path / "grid" / "grid-passkey.png").is_file()


@pytest.mark.slow
def test_a_tiny_attention_model_trained_on_passkeys_passes_at_its_training_length(kjv_data, tmp_path):
    from lm.eval.longctx.passkey import passkey

    rows = passkey(kjv_data, str(tmp_path), length=256, eval_lengths=[256], samples=20)
    accuracy = sum(r["accuracy"] for r in rows) / len(rows)
    assert accuracy > 0.9, rows

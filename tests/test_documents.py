"""data.reset_at_documents end to end: `lm compare documents` trains with and without resets (real Lightning runs),
the checkpoint carries the setting, and `lm eval ppl` evaluates a resetting model with it, per-position NLL counted
from each document's start (checked against every document run alone)."""

import csv
import json

import pytest
import torch
import torch.nn.functional as F

from lm.cli import main
from lm.training.checkpoint import load_model, newest_checkpoint
from lm.training.data import TokenStream, ValidationWindows


@pytest.fixture(scope="module")
def documents_demo(kjv_data, tmp_path_factory):
    from lm.compare.documents import compare_documents

    out = tmp_path_factory.mktemp("documents")
    result = compare_documents(out=str(out), mixers=["gated_deltanet"], seeds=[0], steps=2, seq_len=32,
                               global_batch=4, d_model=32, data=kjv_data, workers=1, eval_windows=4)
    return out, result


def test_compare_documents_trains_both_settings_and_tabulates_them(documents_demo, kjv_data):
    out, result = documents_demo
    assert [(r["mixer"], r["setting"]) for r in result["rows"]] == [("gated_deltanet", "carry"),
                                                                    ("gated_deltanet", "reset")]
    separator = json.loads(open(f"{kjv_data}/manifest.json").read())["tokenizer"]["sep_id"]
    carry = newest_checkpoint(out / "runs" / "gated_deltanet-carry-s0" / "checkpoints")
    reset = newest_checkpoint(out / "runs" / "gated_deltanet-reset-s0" / "checkpoints")
    assert load_model(carry)[1]["model"]["document_separator"] is None
    assert load_model(reset)[1]["model"]["document_separator"] == separator
    ppl = out / "runs" / "gated_deltanet-reset-s0" / "eval" / "ppl-validation-T32" / "ppl.json"
    ppl = json.loads(ppl.read_text())
    assert ppl["reset_at_documents"] and ppl["positions"] == "document"
    assert "| gated_deltanet | reset |" in (out / "documents.md").read_text()
    assert (out / "documents.png").stat().st_size > 1000
    with open(out / "documents.csv") as f:
        assert len(list(csv.DictReader(f))) == 2


class Windows(list):
    seq_len = 32


def test_per_position_nll_with_resets_equals_each_document_alone(documents_demo, kjv_data):
    """The packed windows' NLL by position in the document, against every document of every window run alone."""
    from lm.eval.ppl import per_position_nll

    out, _ = documents_demo
    model, _ = load_model(newest_checkpoint(out / "runs" / "gated_deltanet-reset-s0" / "checkpoints"))
    model = model.double()
    separator = model.cfg.document_separator
    every = ValidationWindows(TokenStream(kjv_data, "validation", verify=False), 32)
    crossing = [i for i in range(len(every)) if (every[i][:-1] == separator).any()]
    windows = Windows([every[i] for i in crossing[:8] + [crossing[0] + 1, crossing[0] + 2]])  # and 2 without
    sums, tokens, _, _ = per_position_nll(model, windows, 4, separator)
    want_sums, want_tokens = torch.zeros(32, dtype=torch.float64), torch.zeros(32, dtype=torch.long)
    resets = 0
    for i in range(len(windows)):
        window = windows[i]
        inputs, targets = window[:-1], window[1:]
        starts = sorted({0, *(inputs == separator).nonzero().flatten().tolist()})
        resets += len(starts) - 1
        for start, end in zip(starts, starts[1:] + [32]):
            logits, _ = model(inputs[None, start:end])
            nll = F.cross_entropy(logits[0].float(), targets[start:end], reduction="none").double()
            want_sums[:end - start] += nll
            want_tokens[:end - start] += 1
    assert resets > 0  # the windows do cross documents
    assert torch.equal(torch.from_numpy(tokens), want_tokens)
    torch.testing.assert_close(torch.from_numpy(sums), want_sums, rtol=0, atol=1e-4)


def test_a_document_separator_needs_reset_at_documents(kjv_data, tmp_path, capsys):
    run = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(f"""
run_dir: {run}
model: {{vocab_size: 512, d_model: 32, n_layers: 1, n_heads: 2, head_dim: 16, max_seq_len: 32}}
data: {{path: {kjv_data}, seq_len: 32, micro_batch: 2}}
strategy: {{accelerator: cpu}}
trainer: {{max_steps: 1}}
""")
    for extra, message in ((["--model.document_separator", "0"], "set that instead"),
                           (["--model.document_separator", "3", "--data.reset_at_documents", "true"],
                            "is not the separator")):
        assert main(["train", "--config", str(config), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not run.exists()

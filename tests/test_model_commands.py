"""`lm export`, `lm eval ppl` and `lm generate` on a tiny trained run, through the command line in this process: an
export never silently replaces another model, ppl.json records the length the run trained at, reading or generating
past the model's max_seq_len says so in one line, and each command that writes says where."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file

from lm.cli import main

SEQ = 32


@pytest.fixture(scope="module")
def run(kjv_data, tmp_path_factory) -> Path:
    """Two optimizer steps of a 2-layer hybrid at length 32 (max_seq_len 32), a checkpoint after each."""
    folder = tmp_path_factory.mktemp("model-commands")
    config = folder / "run.yaml"
    config.write_text(f"""
run_dir: {folder / "run"}
model: {{vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 2, head_dim: 16, max_seq_len: {SEQ},
        layer_pattern: "gated_deltanet,attention"}}
data: {{path: {kjv_data}, seq_len: {SEQ}, micro_batch: 2, num_workers: 0, val_windows: 2}}
strategy: {{accelerator: cpu}}
trainer: {{max_steps: 2, val_every: 2, ckpt_every: 1, keep_last: 2, log_every: 1, progress_bar: false}}
""")
    assert main(["train", "--config", str(config)]) == 0
    return folder / "run"


def checkpoint(run: Path, step: int) -> str:
    return str(run / "checkpoints" / f"step={step:08d}.ckpt")


def test_export_refuses_an_out_that_holds_another_model_unless_overwrite(run, tmp_path, capsys):
    out = tmp_path / "export"
    export = ["export", "--out", str(out), "--checkpoint"]
    assert main([*export, checkpoint(run, 1)]) == 0
    said = capsys.readouterr()
    assert said.out == "" and said.err == f"exported {checkpoint(run, 1)} -> {out} (lm format)\n"  # where
    assert main([*export, checkpoint(run, 1)]) == 0  # the same export again
    first = (out / "model.safetensors").read_bytes()
    refusals = {
        "another checkpoint": ([*export, checkpoint(run, 2)], f"already holds an export of another checkpoint ("
                                                             f"{Path(checkpoint(run, 1)).resolve()})"),
        "another format": ([*export, checkpoint(run, 1), "--format", "hf"], "this checkpoint's export in lm format"),
    }
    for name, (argv, said) in refusals.items():
        capsys.readouterr()
        assert main(argv) == 2, name
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and said in lines[0] and "pass --overwrite true" in lines[0], (name, lines)
        assert (out / "model.safetensors").read_bytes() == first, name  # nothing written
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    assert main(["export", "--out", str(notes), "--checkpoint", checkpoint(run, 2)]) == 2
    assert "already holds files that are not an export" in capsys.readouterr().err
    assert sorted(p.name for p in notes.iterdir()) == ["todo.txt"]

    assert main([*export, checkpoint(run, 2), "--overwrite", "true"]) == 0
    second = load_file(str(out / "model.safetensors"))
    assert any(not torch.equal(second[k], tensor) for k, tensor in load(first).items())  # step 2's weights
    assert main([*export, checkpoint(run, 2)]) == 0  # now it holds step 2's export


def test_ppl_records_the_trained_length_and_warns_past_max_seq_len(run, tmp_path, capsys):
    capsys.readouterr()
    ppl = ["eval", "ppl", "--checkpoint", str(run), "--max_windows", "2"]
    assert main([*ppl, "--out", str(tmp_path / "within")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["seq_len"] == SEQ and err == f"lm eval ppl: wrote ppl.json, per_position.csv and .png " \
                                                         f"in {tmp_path / 'within'}\n"  # no warning within it
    assert main([*ppl, "--seq_len", str(4 * SEQ), "--out", str(tmp_path / "past")]) == 0
    out, err = capsys.readouterr()
    result = json.loads((tmp_path / "past" / "ppl.json").read_text())
    assert json.loads(out) == result
    assert (result["seq_len"], result["trained_seq_len"], result["max_seq_len"]) == (4 * SEQ, SEQ, SEQ)
    warning, where = err.splitlines()
    assert warning.startswith(f"lm eval ppl: warning: windows of up to {4 * SEQ} tokens, past the model's max_seq_len "
                              f"{SEQ}: its layers (gated_deltanet x1, attention x1) run at any length but were never "
                              "trained past") and "length extrapolation" in warning
    assert where.startswith("lm eval ppl: wrote ") and str(tmp_path / "past") in where
    assert main([*ppl, "--multiples", "[1, 2]", "--out", str(tmp_path / "multiples")]) == 0
    err = capsys.readouterr().err
    assert f"warning: windows of up to {2 * SEQ} tokens" in err
    for length in (SEQ, 2 * SEQ):
        written = json.loads((tmp_path / "multiples" / f"ppl-validation-T{length}" / "ppl.json").read_text())
        assert (written["seq_len"], written["trained_seq_len"]) == (length, SEQ)


def test_generate_warns_when_the_prompt_and_new_tokens_reach_past_max_seq_len(run, capsys):
    generate = ["generate", "--checkpoint", str(run), "--prompt", "In the", "--temperature", "0"]
    capsys.readouterr()
    assert main([*generate, "--max_new_tokens", "4"]) == 0
    assert capsys.readouterr().err == ""
    assert main([*generate, "--max_new_tokens", str(SEQ)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("In the")  # the text, on stdout alone
    (warning,) = err.splitlines()
    assert warning.startswith("lm generate: warning: the prompt (") and f"and --max_new_tokens {SEQ} reach " in warning
    assert f"past the model's max_seq_len {SEQ}: its layers (gated_deltanet x1, attention x1)" in warning


def test_mqar_says_where_it_wrote_its_rows(tmp_path, capsys):
    from lm.eval.mqar import mqar_table

    rows = mqar_table(mixers=["attention"], steps=2, batch=4, d_model=16, n_heads=1, head_dim=16,
                      json_out=str(tmp_path / "rows.json"))
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    assert capsys.readouterr().err == f"lm eval mqar: wrote {tmp_path / 'rows.json'}\n"

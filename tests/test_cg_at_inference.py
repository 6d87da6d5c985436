"""`lm research test-time`: a Mesa checkpoint at every CG setting and another model as a fixed point, each figure set
against the inference FLOPs per token it spent; its 30-step loss is what `lm eval ppl` gives the checkpoint."""

import csv
import json
import math

import pytest

from lm.accounting.flops import forward_flops_per_token
from lm.cli import main
from lm.model import LMConfig

MODEL = "vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 2, head_dim: 16, max_seq_len: 32"


@pytest.fixture(scope="module")
def runs(kjv_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("test-time")
    made = {}
    for name, mixer in (("mesa", "mixer: mesa, mixer_options: {mesa: {chunk_size: 16, backend: torch}}"),
                        ("attention", "mixer: attention")):
        config = tmp / f"{name}.yaml"
        config.write_text(f"""
seed: 0
model: {{{MODEL}, {mixer}}}
data: {{path: {kjv_data}, seq_len: 32, micro_batch: 4, num_workers: 0, val_windows: 2}}
optim: {{lr: 3.0e-3, warmup_steps: 1}}
trainer: {{max_steps: 3, val_every: 1000, ckpt_every: 1000, log_every: 1, progress_bar: false}}
strategy: {{accelerator: cpu}}
""")
        # In this process, as the tests below run lm: a fresh one would import torch and Lightning again.
        assert main(["train", "--config", str(config), "--run_dir", str(tmp / name)]) == 0
        made[name] = tmp / name
    return made


def test_every_setting_against_the_flops_it_spent(runs, tmp_path):
    out = tmp_path / "out"
    assert main(["research", "test-time", "--runs", json.dumps([str(runs["mesa"]), str(runs["attention"])]),
                 "--out", str(out), "--steps", "[0, 2, 30]", "--tols", "[0.01]", "--max_windows", "6",
                 "--recall_lengths", "[512]", "--recall_examples_per_length", "2"]) == 0
    with open(out / "results.csv") as f:
        rows = {(r["arch"], r["setting"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [("attention", "fixed"), ("mesa", "cg 0"), ("mesa", "cg 2"), ("mesa", "cg 30"),
                            ("mesa", "tol 0.01")]
    flops = {setting: float(row["flops_per_token"]) for (arch, setting), row in rows.items() if arch == "mesa"}
    mesa = LMConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, head_dim=16, max_seq_len=32, mixer="mesa",
                    mixer_options={"mesa": {"chunk_size": 16, "backend": "torch"}})
    for steps in (0, 2, 30):  # a fixed step count is the analytic forward at those steps
        at = LMConfig(**{**mesa.__dict__, "mixer_options": {"mesa": {"chunk_size": 16, "cg_steps": steps}}})
        assert flops[f"cg {steps}"] == pytest.approx(forward_flops_per_token(at, 32), rel=1e-12)
    assert flops["cg 2"] < flops["tol 0.01"] < flops["cg 30"]  # the tolerance stopped between them
    assert float(rows[("mesa", "cg 2")]["cg_steps_run"]) == 2 and rows[("attention", "fixed")]["cg_steps_run"] == ""
    assert 2 < float(rows[("mesa", "tol 0.01")]["cg_steps_run"]) < 30
    attention = LMConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, head_dim=16, max_seq_len=32)
    assert float(rows[("attention", "fixed")]["flops_per_token"]) == pytest.approx(
        forward_flops_per_token(attention, 32), rel=1e-12)
    for row in rows.values():
        assert math.isfinite(float(row["recall_nll_T512"])) and 0 <= float(row["recall_acc_T512"]) <= 1

    # The checkpoint's own setting (30 steps) scores as lm eval ppl scores it on the same windows.
    assert main(["eval", "ppl", "--checkpoint", str(runs["mesa"]), "--max_windows", "6", "--out",
                 str(tmp_path / "ppl")]) == 0
    ppl = json.loads((tmp_path / "ppl" / "ppl.json").read_text())
    assert float(rows[("mesa", "cg 30")]["val_loss"]) == pytest.approx(ppl["loss"], rel=1e-6)
    assert float(rows[("mesa", "cg 0")]["val_loss"]) != pytest.approx(ppl["loss"], rel=1e-5)  # the setting counts
    with open(out / "nll_by_position.csv") as f:
        curve = [r for r in csv.DictReader(f) if r["setting"] == "cg 30"]
    assert int(curve[0]["position"]) == 1 and int(curve[-1]["position"]) == 32
    assert "| mesa | tol 0.01 |" in (out / "test_time.md").read_text() and (out / "test_time.png").stat().st_size


def test_a_bad_setting_is_refused_in_one_line_before_anything_is_written(runs, tmp_path, capsys):
    assert main(["research", "test-time", "--runs", json.dumps([str(runs["mesa"])]), "--steps", "[-1]",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--steps must be counts >= 0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_ladder_gives_its_largest_rungs_runs_named_as_the_ladder_names_them(tmp_path):
    """--ladder OUT: the finished runs of the rung with the most parameters, every arch (a variant by its ladder name)
    and seed; an unfinished run (no checkpoints) is left out."""
    from lm.research.cg_at_inference import describe, largest_rung_runs

    def run(name: str, arch: str, rung: str, d_model: int, finished: bool = True) -> None:
        (tmp_path / "configs").mkdir(exist_ok=True)
        (tmp_path / "configs" / f"{name}.yaml").write_text(f"# {arch} at rung {rung}: 1 parameters. Written by lm.\n")
        folder = tmp_path / "runs" / name
        (folder / "checkpoints" if finished else folder).mkdir(parents=True)
        folder.joinpath("config.yaml").write_text(f"seed: {name[-1]}\ndata: {{path: d, seq_len: 8}}\n"
                                                  f"model: {{mixer: mesa, d_model: {d_model}, n_heads: 2}}\n")

    run("mesa-9k-seed0", "mesa", "9k", 32)
    run("mesa@cg_tol=1e-3-90k-seed0", "mesa@cg_tol=1e-3", "90k", 64)
    run("mesa@cg_tol=1e-3-90k-seed1", "mesa@cg_tol=1e-3", "90k", 64)
    run("mesa-90k-seed2", "mesa", "90k", 64, finished=False)
    found = largest_rung_runs(tmp_path)
    assert [p.name for p in found] == ["mesa@cg_tol=1e-3-90k-seed0", "mesa@cg_tol=1e-3-90k-seed1"]
    assert describe(found[1]) == {"arch": "mesa@cg_tol=1e-3", "seed": 1, "data": "d", "seq_len": 8}
    alone = tmp_path / "elsewhere" / "run"
    alone.mkdir(parents=True)
    alone.joinpath("config.yaml").write_text("seed: 4\ndata: {path: d, seq_len: 8}\n"
                                             "model: {mixer: mesa, mixer_options: {mesa: {cg_tol: 1.0e-3}}}\n")
    assert describe(alone)["arch"] == "mesa@cg_tol=0.001"  # a run outside a ladder: named by how it solves


def test_a_setting_builds_its_own_model_and_leaves_the_trained_one_alone(runs):
    """Each setting is a model built with that setting's solver options and the trained weights; the trained model's
    mixers keep the options they were built with."""
    import torch

    from lm.research.cg_at_inference import at_setting
    from lm.training.checkpoint import load_model

    trained, _ = load_model(runs["mesa"])
    before = [block.mixer.options for block in trained.blocks]
    model = at_setting(trained, {"cg_steps_eval": 2, "cg_tol": 1e-2})
    assert [block.mixer.options for block in trained.blocks] == before
    assert all((b.mixer.options.cg_steps_eval, b.mixer.options.cg_tol) == (2, 1e-2) for b in model.blocks)
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), model.state_dict().values()))

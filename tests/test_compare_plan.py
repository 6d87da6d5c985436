"""`lm compare plan`: every architecture matched within 2% at three budgets in both modes, checked against the FLOP
formulas and a built model; the budget arithmetic; the written configs load; bad input is one line and exit status 2."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lm.accounting.flops import param_count, train_flops_per_token
from lm.compare.plan import plan
from lm.model import LanguageModel, LMConfig
from lm.slurm.submit import sweep_runs
from lm.training.config import parse_run_config
from lm.util.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
ARCHS = "attention,mamba2,mlstm,deltanet,gated_deltanet,mesa,mesa+attention"
BUDGETS = {  # name -> plan options: a CPU demo, the paper's 145M class, its 1B class
    "tiny": {"budget": 1e15, "vocab_size": 4096, "seq_len": 256, "base": str(ROOT / "configs" / "demo.yaml")},
    "145m": {"budget": 2.6e18, "base": str(ROOT / "configs" / "attention" / "145m.yaml")},
    "1b": {"budget": 1.2e20, "base": str(ROOT / "configs" / "attention" / "1b.yaml")},
}


@pytest.fixture(scope="module")
def plans() -> dict:
    return {(size, mode): plan(archs=ARCHS, match=mode, dry_run=True, **options)
            for size, options in BUDGETS.items() for mode in ("params", "flops")}


def built_params(cfg: LMConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in LanguageModel(cfg).parameters())


@pytest.mark.parametrize("mode", ["params", "flops"])
@pytest.mark.parametrize("size", list(BUDGETS))
def test_every_arch_matches_within_2_percent(plans, size, mode):
    result = plans[size, mode]
    seq_len, target = result["seq_len"], result["target_params"]
    assert target == pytest.approx(math.sqrt(BUDGETS[size]["budget"] / 120))  # Chinchilla: C = 6 N (20 N)
    rows = {r["arch"]: r for r in result["archs"]}
    assert list(rows) == ["attention", "mamba2", "mlstm", "deltanet", "gated_deltanet", "mesa", "mesa_attention"]
    reference = LMConfig(**rows["attention"]["model"])
    for arch, row in rows.items():
        cfg = LMConfig(**row["model"])
        assert cfg.layer_mixers()[:2] == (["mesa", "attention"] if arch == "mesa_attention" else [arch] * 2)
        params = built_params(cfg) if size == "tiny" else param_count(cfg)
        assert params == row["params"]
        if mode == "params":
            assert abs(params / target - 1) <= 0.02, arch
        else:
            ratio = train_flops_per_token(cfg, seq_len) / train_flops_per_token(reference, seq_len)
            assert abs(ratio - 1) <= 0.02, arch
        assert abs(row["error"]) <= 0.02
        # the budget buys tokens x FLOPs/token; steps cover them in whole global batches
        assert row["tokens"] * train_flops_per_token(cfg, seq_len) == pytest.approx(BUDGETS[size]["budget"],
                                                                                    rel=1e-6)
        assert row["steps"] == round(row["tokens"] / (result["global_batch"] * seq_len))
    if mode == "flops":  # equal FLOPs per token: equal tokens within 2%
        tokens = [r["tokens"] for r in rows.values()]
        assert max(tokens) / min(tokens) <= 1.02 / 0.98


def test_the_paper_sizes_come_out_of_the_ladder():
    for size in ("145m", "1b"):
        paper = parse_run_config(["--config", str(ROOT / "configs" / "attention" / f"{size}.yaml")])[0].model
        result = plan(archs="attention", params=param_count(paper), dry_run=True)
        assert LMConfig(**result["archs"][0]["model"]) == paper


def test_without_a_base_the_plan_is_the_papers_recipe_as_its_help_says():
    """`lm compare plan --help` names the batch a plan without --base trains at; the plan trains at it, and it is the
    paper's (configs/attention/1b.yaml): a 1B model at 256 sequences of 2048 a step, not lm train's one micro-batch."""
    import re

    from lm.util.commands import function_parser

    text = " ".join(function_parser(plan, "lm compare plan").format_help().split())
    (stated,) = re.findall(r"without --base, the paper's (\d+)\)", text)
    paper = parse_run_config(["--config", str(ROOT / "configs" / "attention" / "1b.yaml")])[0]
    (row,) = plan(archs="attention", params=param_count(paper.model), dry_run=True)["archs"]
    assert int(stated) == paper.data.global_batch == 256
    assert row["steps"] == round(row["tokens"] / (256 * 2048)) < 50_000  # ~20 tokens/parameter in ~40k steps


def test_params_alone_gives_every_arch_20_tokens_per_parameter():
    result = plan(archs="attention,mesa", params=3e6, vocab_size=4096, seq_len=256, dry_run=True)
    for row in result["archs"]:
        assert row["tokens"] == 60_000_000
        assert row["total_flops"] == pytest.approx(row["tokens"] * row["train_flops_per_token"])
    attention, mesa = result["archs"]
    assert mesa["total_flops"] > attention["total_flops"]  # same size and tokens; Mesa's CG costs more


def test_written_configs_load_and_form_the_sweep(tmp_path, capsys):
    out = tmp_path / "plan"
    result = plan(archs=ARCHS, match="flops", seeds=[0, 1], out=str(out), **BUDGETS["tiny"])
    assert "| mesa_attention |" in (out / "plan.md").read_text()
    assert yaml.safe_load((out / "plan.json").read_text())["archs"][0]["arch"] == "attention"
    written = sorted((out / "configs").glob("*.yaml"))
    assert len(written) == 7 * 3 * 2  # archs x the default lr grid x seeds
    for row in result["archs"]:
        assert row["lrs"] == pytest.approx([1.5e-3, 3e-3, 6e-3])  # configs/demo.yaml's lr x 0.5, 1, 2
        for path in row["configs"]:
            config = parse_run_config(["--config", path])[0]
            assert config.model == LMConfig(**row["model"])
            assert config.optim.lr in row["lrs"] and config.seed in (0, 1)
            assert config.trainer.max_steps == row["steps"]
            assert config.data.seq_len == 256 and config.data.path == "runs/demo/data"
            assert Path(config.run_dir) == out / "runs" / Path(path).stem
    runs = sweep_runs(str(out / "sweep.yaml"))
    assert sorted(args[1] for args in runs) == [str(p) for p in written]


def test_a_short_run_gets_its_warmup_and_intervals_cut_to_fit(tmp_path):
    """145m.yaml warms up for 2000 steps and validates every 1000; a 100-step run would never leave warmup."""
    result = plan(archs="attention,mesa+attention", params=146e6, budget=100 * 256 * 2048 * 1.008e9,
                  lrs={"attention": [3e-3], "mesa+attention": [2e-3]}, out=str(tmp_path),
                  base=BUDGETS["145m"]["base"])
    attention, hybrid = result["archs"]
    assert attention["steps"] == 100 and hybrid["lrs"] == [2e-3]
    config = parse_run_config(["--config", attention["configs"][0]])[0]
    assert (config.optim.warmup_steps, config.trainer.val_every, config.trainer.ckpt_every) == (10, 100, 100)
    assert config.data.global_batch == 256 and config.optim.betas == (0.9, 0.98)


def test_submit_renders_an_array_job(tmp_path, capsys):
    plan(archs="attention,mesa", lrs=[1e-3], out=str(tmp_path), submit=True, slurm=["--dry_run"],
         **BUDGETS["tiny"])
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-1" in script and "mesa-lr0.001-seed0" in script


@pytest.mark.parametrize("options, message", [
    ({"archs": "attention,transformer", "budget": 1e18}, "unknown architecture 'transformer'"),
    ({"archs": "mesa,mesa", "budget": 1e18}, "named twice"),
    ({"archs": "mesa"}, "give --budget"),
    ({"archs": "mesa", "budget": 1e9}, "too small"),
    ({"archs": "mesa", "params": 3e6, "budget": 1e10, "vocab_size": 4096}, "less than one step"),
    ({"archs": "mesa", "match": "flops", "params": 1e6, "vocab_size": 4096, "seq_len": 256}, "cannot match mesa"),
    ({"archs": "mesa", "params": 3e6, "lrs": {"attention": [1e-3]}}, "no grid for mesa"),
    ({"archs": "mesa", "params": 3e6, "base": "missing.yaml"}, "not found"),
])
def test_impossible_requests_are_user_errors(options, message, tmp_path):
    with pytest.raises(UserError, match=message):
        plan(dry_run=True, out=str(tmp_path), **options)


def test_cli_plans_and_rejects_a_bad_option_with_one_line(tmp_path):
    command = [sys.executable, "-m", "lm.cli", "compare", "plan"]
    good = subprocess.Popen([*command, "--archs", "attention,mesa+attention", "--match", "flops", "--budget", "1e15",
                             "--vocab_size", "4096", "--seq_len", "256", "--out", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bad = subprocess.Popen([*command, "--budjet", "1e15"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    out, err = good.communicate(timeout=120)
    assert good.returncode == 0, err
    assert "| mesa_attention |" in out and (tmp_path / "sweep.yaml").is_file()
    _, err = bad.communicate(timeout=120)
    assert bad.returncode == 2
    assert err.count("\n") == 1 and "unknown config key 'budjet'" in err


def test_the_window_of_swa_is_half_the_planned_length_unless_the_base_sets_it(tmp_path):
    """The MesaNet paper's SWA sees 1024 of 2048 tokens; planned at 128 tokens it sees 64 (a window of 1024 would make
    it attention there, as it did in the demo). A window the base config gives is kept."""
    def window(base: str, seq_len: int) -> int:
        result = plan(archs="swa,attention", params=2e6, vocab_size=512, seq_len=seq_len, base=base, dry_run=True)
        model = {r["arch"]: r["model"] for r in result["archs"]}["swa"]
        return LanguageModel(LMConfig(**model)).blocks[0].mixer.window

    demo = str(ROOT / "configs" / "demo.yaml")
    assert (window(demo, 128), window(demo, 2048)) == (64, 1024)
    base = tmp_path / "base.yaml"
    raw = yaml.safe_load(Path(demo).read_text())
    raw["model"]["mixer_options"] = {"swa": {"window": 16}}
    base.write_text(yaml.safe_dump(raw))
    assert window(str(base), 128) == 16


def test_data_sets_the_prepared_data_of_every_config(tmp_path, capsys):
    """--data is data.path of every written config, a mixture in the base config giving way to it; without it, the
    configs keep the base config's data (without a base: lm train's default, data/prepared)."""
    from lm.cli import main

    mixture = tmp_path / "mixture.yaml"
    raw = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    raw["data"] = {**{k: v for k, v in raw["data"].items() if k != "path"},
                   "sources": [{"path": "data/a", "weight": 0.5}, {"path": "data/b", "weight": 0.5}]}
    mixture.write_text(yaml.safe_dump(raw))
    tiny = ["--archs", "attention,mesa", "--lrs", "[1e-3]", "--budget", "1e15", "--vocab_size", "4096", "--seq_len",
            "256"]

    def data_of(out: str, *options: str) -> list:
        assert main(["compare", "plan", *tiny, "--out", str(tmp_path / out), *options]) == 0
        configs = sorted((tmp_path / out / "configs").glob("*.yaml"))
        assert len(configs) == 2
        return [parse_run_config(["--config", str(c)])[0].data for c in configs]

    for data in data_of("mine", "--base", str(ROOT / "configs" / "demo.yaml"), "--data", "data/mine") + \
            data_of("mine-mixture", "--base", str(mixture), "--data", "data/mine"):
        assert (data.path, data.sources, data.seq_len, data.micro_batch) == ("data/mine", None, 256, 8)
    assert [d.path for d in data_of("base", "--base", str(ROOT / "configs" / "demo.yaml"))] == ["runs/demo/data"] * 2
    assert [d.first_path for d in data_of("bare")] == ["data/prepared"] * 2
    kept = data_of("mixture", "--base", str(mixture))
    assert [[s.path for s in d.sources] for d in kept] == [["data/a", "data/b"]] * 2
    capsys.readouterr()


def test_a_variant_carries_its_options_and_a_tolerance_run_is_planned_at_its_expected_steps(tmp_path):
    """"mesa@cg_tol=1e-3" is Mesa with that option in its configs, matched as Mesa is; its planned FLOPs charge the
    expected CG steps (lm.ops.flops.expected_cg_steps), not cg_steps, and the plan says so."""
    from lm.ops.flops import expected_cg_steps

    result = plan(archs="mesa,mesa@cg_tol=1e-3", params=3e6, vocab_size=4096, seq_len=256, out=str(tmp_path),
                  lrs=[1e-3])
    fixed, stopped = result["archs"]
    assert stopped["arch"] == "mesa@cg_tol=1e-3" and stopped["model"]["mixer_options"]["mesa"]["cg_tol"] == 1e-3
    assert {k: v for k, v in stopped["model"].items() if k != "mixer_options"} == \
        {k: v for k, v in fixed["model"].items() if k != "mixer_options"}
    steps = expected_cg_steps(30, 1e-3)
    assert 0 < steps < 30
    at_steps = LMConfig(**{**fixed["model"], "mixer_options": {"mesa": {"cg_steps": steps}}})
    assert stopped["train_flops_per_token"] == train_flops_per_token(at_steps, 256) < fixed["train_flops_per_token"]
    assert any(f"planned at {steps} expected CG steps" in note for note in result["notes"])
    config = yaml.safe_load(Path(stopped["configs"][0]).read_text())
    assert config["model"]["mixer_options"] == {"mesa": {"cg_tol": 1e-3}}
    with pytest.raises(UserError, match="not OPTION=VALUE for an option of mesa"):
        plan(archs="mesa@window=3", params=3e6, dry_run=True)


def test_a_context_parallel_base_plans_its_replicas_and_carries_the_split(tmp_path):
    """configs/long_context/'s recipe: 8 processes, each window over 4 of them: a global batch of 16 windows is
    micro-batches of 1 on 2 replicas (accumulation 8), not on 8 processes, and every config keeps the split."""
    out = tmp_path / "plan"
    result = plan(archs=["mesa", "attention"], params=1e9, lrs=[2e-3], out=str(out),
                  base=str(Path(__file__).resolve().parents[1] / "configs" / "long_context" / "mesa_1b_32k.yaml"))
    assert "Context parallel: each window split over 4 ranks of 8,192 tokens" in (out / "plan.md").read_text()
    for row in result["archs"]:
        config = parse_run_config(["--config", row["configs"][0]])[0]
        assert config.strategy.context_parallel == 4 and config.strategy.data_parallel_size == 2
        assert config.data.global_batch == 16 and config.data.seq_len == 32768


THREE_TO_ONE = ["gated_deltanet", "gated_deltanet", "gated_deltanet", "attention"]


def test_a_hybrid_is_planned_in_whole_patterns(capsys):
    """A 3:1 hybrid keeps its attention layer: where the reference attention model is 2 layers deep (the size at which
    the plan once gave it 2 layers, both Gated DeltaNet) and at the paper's 145M (14 layers), it gets a depth of whole
    4-layer patterns, within 2% of the target parameters. The first as `lm compare plan` is typed."""
    from lm.cli import main

    assert main(["compare", "plan", "--archs", f"[{'+'.join(THREE_TO_ONE)}]", "--params", "2e5", "--vocab_size", "512",
                 "--dry_run", "true"]) == 0
    out = capsys.readouterr().out
    assert "Reference: attention, d_model 80, 2 layers" in out
    header = next(line for line in out.splitlines() if line.startswith("| arch |")).split(" | ")
    row = next(line for line in out.splitlines() if line.startswith(f"| {'_'.join(THREE_TO_ONE)} |")).split(" | ")
    assert int(row[header.index("n_layers")]) % 4 == 0 and abs(float(row[header.index("error vs target")][:-1])) <= 2
    result = plan(archs=["+".join(THREE_TO_ONE)], params=1.46e8, dry_run=True)
    cfg = LMConfig(**result["archs"][0]["model"])
    assert cfg.n_layers in (12, 16) and cfg.layer_mixers() == THREE_TO_ONE * (cfg.n_layers // 4)
    assert abs(param_count(cfg) / 1.46e8 - 1) <= 0.02

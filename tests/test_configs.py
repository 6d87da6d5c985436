"""Shipped configs parse; the paper-size configs are what lm/compare/paper_sizes.py writes and match the attention
model's parameters (a mixer need not have them: the generator writes them for every registered mixer)."""

from functools import cache
from pathlib import Path

import pytest
import torch
import yaml

from lm.accounting.flops import param_count
from lm.compare import paper_sizes
from lm.model import LanguageModel, LMConfig
from lm.training.config import parse_run_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SIZES = ("145m", "400m", "1b")


@cache
def parsed(path: Path) -> tuple:
    """parse_run_config of a shipped config, once per path for the whole module (jsonargparse builds its parser on
    every call: the paper-size tests read each config up to three times)."""
    return parse_run_config(["--config", str(path)])


def model_of(path: Path) -> LMConfig:
    return parsed(path)[0].model


# bench/, research/ and compare/ hold a command's settings (`--config` of `lm bench ...`, `lm research ...` or
# `lm compare ...`), not run configs; so do ladder/'s ladder files (tests/test_ladder.py loads them), whose
# *_base.yaml are run configs, data/'s recipes (`lm prepare --recipe`; tests/test_prepare_parallel.py loads them) and
# state_tracking/'s presets (`lm eval state-tracking --preset`; tests/test_state_tracking.py loads them).
RUN_CONFIGS = sorted(p for p in CONFIGS.rglob("*.yaml")
                     if p.parent.name not in ("bench", "research", "compare", "data", "state_tracking")
                     and (p.parent.name != "ladder" or p.stem.endswith("_base")))


@pytest.mark.parametrize("path", sorted((CONFIGS / "compare").glob("*.yaml")), ids=lambda p: p.name)
def test_every_comparison_config_parses_as_its_commands_options(path):
    from lm.util.commands import function_parser, load_command

    command = f"compare {path.stem}"
    assert function_parser(load_command(command), command).parse_args(["--config", str(path)])


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_parses(path):
    config, _, yaml = parsed(path)
    assert config.data.seq_len <= config.model.max_seq_len
    assert "model:" in yaml


ARCHS = sorted(p.parent.name for p in CONFIGS.glob("*/1b.yaml"))


def test_the_reference_and_a_mesa_hybrid_have_paper_size_configs():
    assert {"attention", "mesa_attention"} <= set(ARCHS)
    assert model_of(CONFIGS / "mesa_attention" / "1b.yaml").layer_mixers()[:4] == ["mesa", "attention"] * 2


PAPER_SIZE_CONFIGS = sorted(CONFIGS / arch / f"{size}.yaml" for arch in ARCHS for size in SIZES)


@pytest.mark.parametrize("path", PAPER_SIZE_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_paper_size_configs_are_what_the_generator_writes(path):
    """Each existing configs/<arch>/<size>.yaml holds what `python -m lm.compare.paper_sizes` writes (the same
    YAML; the comments' figures are not compared): attention's is the generator's input, its micro_batch set."""
    arch, size = path.parent.name, path.stem
    assert arch == "attention" or arch in paper_sizes.generated(), f"{arch}: no longer generated"
    text = path.read_text() if arch == "attention" else paper_sizes.config_text(arch, size)
    if size != "145m":
        text = paper_sizes.with_micro_batch(text)[0]
    assert yaml.safe_load(text) == yaml.safe_load(path.read_text())


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("arch", sorted(set(ARCHS) - {"attention"}))
def test_paper_sizes_match_attention_within_2_percent(arch, size):
    target = param_count(model_of(CONFIGS / "attention" / f"{size}.yaml"))
    assert abs(param_count(model_of(CONFIGS / arch / f"{size}.yaml")) / target - 1) <= 0.02


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("arch", ARCHS)
def test_formula_parameter_count_equals_the_built_model(arch, size):
    cfg = model_of(CONFIGS / arch / f"{size}.yaml")
    with torch.device("meta"):
        model = LanguageModel(cfg)
    assert param_count(cfg) == model.num_params()


THREE_TO_ONE = "gated_deltanet,gated_deltanet,gated_deltanet,attention"


def test_a_run_config_may_cut_its_pattern_only_by_saying_so(tmp_path):
    """lm train's parser reads model.cycle_pattern (jsonargparse takes LMConfig's fields); without it the 3:1 pattern
    over 2 layers is refused as the config is read."""
    from lm.util.errors import UserError

    config = tmp_path / "cut.yaml"
    config.write_text(f"model: {{n_layers: 2, layer_pattern: '{THREE_TO_ONE}'}}\n")
    with pytest.raises(UserError, match="do not tile model.n_layers 2"):
        parse_run_config(["--config", str(config)])
    model = parse_run_config(["--config", str(config), "--model.cycle_pattern", "true"])[0].model
    assert model.cycle_pattern and model.layer_mixers() == ["gated_deltanet"] * 2


def test_a_generated_hybrid_holds_whole_patterns(monkeypatch):
    """The paper-size generator gives a hybrid whose pattern does not divide attention's depth (14 layers at 145M) the
    nearest depth in whole patterns (12 or 16: the tie goes deeper), then matches its parameters by the MLP."""
    monkeypatch.setitem(paper_sizes.HYBRIDS, "three_to_one", THREE_TO_ONE)
    raw = yaml.safe_load(paper_sizes.config_text("three_to_one", "145m"))
    cfg = LMConfig(**raw["model"])
    attention = model_of(CONFIGS / "attention" / "145m.yaml")
    assert attention.n_layers == 14 and cfg.n_layers == 16
    assert cfg.layer_mixers() == THREE_TO_ONE.split(",") * 4
    assert abs(param_count(cfg) / param_count(attention) - 1) <= 0.02

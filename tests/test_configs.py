"""Shipped configs parse, and every mixer's paper-size config matches the attention model's parameters."""

from pathlib import Path

import pytest
import torch

from lm.accounting.flops import param_count
from lm.config import parse_run_config
from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SIZES = ("145m", "400m", "1b")


def model_of(path: Path) -> LMConfig:
    return parse_run_config(["--config", str(path)])[0].model


# bench/ and compare/ hold a command's settings (`--config` of `lm bench ...` or `lm compare ...`), not run configs.
RUN_CONFIGS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name not in ("bench", "compare"))


@pytest.mark.parametrize("path", sorted((CONFIGS / "compare").glob("*.yaml")), ids=lambda p: p.name)
def test_every_comparison_config_parses_as_its_commands_options(path):
    from lm.cli import function_parser, load_command

    command = f"compare {path.stem}"
    assert function_parser(load_command(command), command).parse_args(["--config", str(path)])


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_parses(path):
    config, _, yaml = parse_run_config(["--config", str(path)])
    assert config.data.seq_len <= config.model.max_seq_len
    assert "model:" in yaml


ARCHS = sorted(p.parent.name for p in CONFIGS.glob("*/1b.yaml"))


def test_every_mixer_and_a_mesa_hybrid_have_paper_size_configs():
    assert set(MIXERS) | {"mesa_attention"} <= set(ARCHS)
    assert model_of(CONFIGS / "mesa_attention" / "1b.yaml").layer_mixers()[:4] == ["mesa", "attention"] * 2


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

"""Shipped configs parse; the paper-size configs are what lm/compare/paper_sizes.py writes and match the attention
model's parameters (a mixer need not have them: the generator writes them for every registered mixer)."""

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


def model_of(path: Path) -> LMConfig:
    return parse_run_config(["--config", str(path)])[0].model


# bench/ and compare/ hold a command's settings (`--config` of `lm bench ...` or `lm compare ...`), not run configs;
# so do ladder/'s ladder files (tests/test_ladder.py loads them), whose *_base.yaml are run configs, and data/'s
# recipes (`lm prepare --recipe`; tests/test_prepare_parallel.py loads them).
RUN_CONFIGS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name not in ("bench", "compare", "data")
                     and (p.parent.name != "ladder" or p.stem.endswith("_base")))


@pytest.mark.parametrize("path", sorted((CONFIGS / "compare").glob("*.yaml")), ids=lambda p: p.name)
def test_every_comparison_config_parses_as_its_commands_options(path):
    from lm.commands import function_parser, load_command

    command = f"compare {path.stem}"
    assert function_parser(load_command(command), command).parse_args(["--config", str(path)])


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_parses(path):
    config, _, yaml = parse_run_config(["--config", str(path)])
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

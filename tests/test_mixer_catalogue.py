"""The checks of a model config that need no torch (lm.model_config, with lm.mixer_catalogue): the mixers' names and
their options' names read from lm/mixers' sources are the registry's; where that read refuses, it refuses in the full
check's words; what it cannot know (a mixer registered from outside lm/mixers, a registration it cannot read) it
leaves to the full check, which `lm train` runs once the whole config has parsed. (That parsing a config imports no
torch: tests/test_layers.py; a mistake in a fresh process: tests/test_preflight.py.)"""

import dataclasses
import json

import pytest
from throwaway_mixer import EMA

from lm.mixer_catalogue import Catalogue, known_mixers, read_catalogue
from lm.mixers import MIXERS, register
from lm.model import LMConfig
from lm.model_config import mixers_built_later
from lm.training.config import parse_run_config
from lm.util.errors import UserError

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16)


@pytest.fixture
def ema():
    mixers = dict(MIXERS)
    register("ema")(EMA)  # as tests/test_mixer_protocol.py registers it
    yield "ema"
    MIXERS.clear()
    MIXERS.update(mixers)


def test_the_catalogue_is_the_registry_read_without_importing_it():
    """Every mixer of lm/mixers, each with its Options' fields in their order (inherited ones first: gated_deltaproduct
    extends gated_deltanet's, which extends deltanet's; swa attention's), and no other."""
    own = {name: cls for name, cls in MIXERS.items() if cls.__module__.startswith("lm.mixers.")}
    assert read_catalogue() == Catalogue({name: tuple(f.name for f in dataclasses.fields(cls.Options))
                                          for name, cls in own.items()}, complete=True)


@pytest.mark.parametrize("change", [
    {"mixer": "transformerx"},
    {"layer_pattern": "attention,mamba3"},
    {"mixer_options": {"mesa2": {}}},
    {"mixer": "kda", "mixer_options": {"kda": {"channel_gates": True, "nonsense": 1}}},
    {"mixer": "gated_deltaproduct", "mixer_options": {"gated_deltaproduct": {"squash": 1.5}}},  # a sibling's option
    {"mixer": "swa", "mixer_options": {"swa": {"windw": 8}}},
], ids=["mixer", "pattern", "options-of", "option", "inherited-options", "inherited-from-attention"])
def test_what_the_sources_refuse_the_full_check_refuses_in_the_same_words(change):
    config = LMConfig(**SMALL)
    for key, value in change.items():  # past __post_init__, to ask each check alone
        setattr(config, key, value)
    with pytest.raises(UserError) as quick:
        config.check_names(read_catalogue())
    with pytest.raises(UserError) as full:
        config.check_mixers()
    assert str(quick.value) == str(full.value)


def test_a_mixer_registered_outside_lm_mixers_is_the_registrys_to_judge(ema):
    """lm/mixers' sources do not know a test's mixer; the registry, which is loaded once anything has registered,
    does: the config is accepted, and the registry still checks its options."""
    config = LMConfig(**SMALL, mixer=ema, mixer_options={ema: {"width": 1.5}})
    assert config.layer_mixers() == [ema, ema] and known_mixers().options[ema] is None
    with pytest.raises(UserError, match=f"unknown mixer '{ema}'"):
        config.check_names(read_catalogue())  # the sources alone would refuse it
    with pytest.raises(UserError, match=f"mixer '{ema}' has no option 'depth'; its options: width"):
        LMConfig(**SMALL, mixer=ema, mixer_options={ema: {"depth": 2}})


def test_what_the_sources_do_not_show_is_left_to_the_full_check(tmp_path):
    """A name registered through a variable makes the catalogue incomplete (no name refused); an Options that extends
    one it cannot find makes that mixer's options unknown (none refused)."""
    (tmp_path / "plain.py").write_text(
        "from dataclasses import dataclass\n\nfrom elsewhere import Base, register\n\n\n"
        "@register('plain')\nclass Plain(Base):\n    @dataclass\n    class Options(Base.Options):\n"
        "        width: int = 1\n\n\nNAME = 'hidden'\nregister(NAME)(Plain)\n")
    catalogue = read_catalogue(tmp_path)
    assert catalogue == Catalogue({"plain": None}, complete=False)
    config = LMConfig(**SMALL)
    for mixer in ("hidden", "plain"):
        config.mixer, config.mixer_options = mixer, {mixer: {"anything": 1}}
        config.check_names(catalogue)  # not refused here: the full check's to say
        with pytest.raises(UserError, match=f"unknown mixer '{mixer}'"):
            config.check_mixers()


def test_a_parsed_config_has_its_mixers_built_once_the_rest_has_passed():
    """Within mixers_built_later an LMConfig leaves the build (an option's value) to its caller; parse_run_config
    builds them after the whole config has parsed, and a value only the build refuses is still refused there."""
    options = {"kda": {"beta_range": [0, 5]}}
    with mixers_built_later():
        config = LMConfig(**SMALL, mixer="kda", mixer_options=options)
    with pytest.raises(UserError, match="option 'beta_range' must be"):
        config.check_mixers()
    with pytest.raises(UserError, match="option 'beta_range' must be"):
        LMConfig(**SMALL, mixer="kda", mixer_options=options)
    with pytest.raises(UserError, match="option 'beta_range' must be"):
        parse_run_config(["--model.mixer", "kda", "--model.mixer_options", json.dumps(options)])

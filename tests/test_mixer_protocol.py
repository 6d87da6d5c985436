"""The mixer protocol (lm.mixers.protocol): a mixer defined outside lm (tests/throwaway_mixer.py, with its float64
reference, as tests/mixer_references would hold it) and registered with one line needs no other file: it trains,
counts its parameters and FLOPs, plans, benchmarks, gets the probes' defaults and passes the generic mixer tests like
the shipped ones; options are checked at parse time; and neither the model nor the accounting nor training names a
mixer."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import test_flops
import test_mixer_contract
import test_mixer_math
import test_mixer_resets
import test_mixers
import torch
import torch.nn.functional as F
import yaml
from mixer_references import REFERENCES, Reference
from test_flops import assert_close, counted
from test_mixer_contract import run_in_pieces
from throwaway_mixer import EMA, ema_context_worker, ema_reference

from lm.accounting import flops
from lm.bench.mixer_speed import bench_mixers
from lm.bench.train_speed import bench_train
from lm.cli import main
from lm.compare import paper_sizes
from lm.compare.demo import DEFAULT_LR, demo_lr
from lm.eval import icl, mqar
from lm.mixers import MIXERS, register
from lm.model import LanguageModel, LMConfig
from lm.training.param_groups import param_groups
from lm.training.schedule import OptimConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ema():
    mixers, references = dict(MIXERS), dict(REFERENCES)
    register("ema")(EMA)  # the one line that adds a mixer
    REFERENCES["ema"] = Reference(ema_reference, variants=[{}, {"width": 1.5}])  # what tests/mixer_references/ema.py
    yield "ema"
    MIXERS.clear()
    MIXERS.update(mixers)
    REFERENCES.clear()
    REFERENCES.update(references)


def test_a_throwaway_mixer_trains_counts_and_keeps_the_contract(ema):
    cfg = LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, mixer=ema,
                   mixer_options={ema: {"width": 1.5}}, max_seq_len=64)
    torch.manual_seed(0)
    model = LanguageModel(cfg)
    assert flops.param_count(cfg) == model.num_params()
    std = model.blocks[0].mixer.o.weight.std().item()  # the residual-output init found it through the marker
    assert std < 0.02 / 2 ** 0.5 * 1.2
    ids = torch.randint(0, 64, (2, 40))
    forward, train = counted(lambda: model(ids)[0])
    assert_close(2 * 40 * flops.forward_flops_per_token(cfg, 40), forward)
    assert_close(2 * 40 * flops.train_flops_per_token(cfg, 40), train)
    optimizer = torch.optim.AdamW(param_groups(model, OptimConfig()), lr=1e-2)  # the training's parameter groups
    loss = lambda: F.cross_entropy(model(ids)[0][:, :-1].flatten(0, 1), ids[:, 1:].flatten())  # noqa: E731
    before = loss()
    before.backward()
    optimizer.step()
    assert loss().item() < before.item()  # 7.6-8.2% lower over seeds 0-7
    mixer = EMA(24, 3, 8).double()
    x = torch.randn(2, 17, 24, dtype=torch.float64)
    full, _ = mixer(x)
    torch.testing.assert_close(run_in_pieces(mixer, x, [5, 6, 15]), full, rtol=0, atol=1e-10)
    torch.testing.assert_close(run_in_pieces(mixer, x, range(1, 17)), full, rtol=0, atol=1e-10)


def test_the_generic_mixer_tests_and_the_probes_take_a_new_mixer(ema):
    """The tests that iterate the registry, run on the new mixer: none needs an entry for it (their tables of options
    fall back to the defaults) but its float64 reference; the probes, the benchmark and the demo give it their
    defaults, and the paper-size generator writes its configs (which the suite does not need)."""
    test_mixer_math.test_every_registered_mixer_has_a_reference(ema)
    for options in REFERENCES[ema].variants:
        test_mixer_math.test_forward_and_gradients_equal_the_papers_equations(ema, options)
    for T in (1, 17, 40):
        test_mixer_contract.test_split_and_token_by_token_equal_one_call(ema, T)
    test_mixer_resets.test_packed_row_equals_each_document_alone(ema, {})
    test_mixer_resets.test_token_by_token_with_resets_equals_one_call(ema, {})
    test_mixers.test_parameter_count_equals_the_built_module(ema)
    test_mixers.test_decay_and_gate_parameters_are_not_decayed(ema)
    test_mixers.test_bf16_forward_and_backward_match_float64(ema)
    for size in test_flops.LAYER_SIZES:
        test_flops.test_mixer_flops_match_the_counter(ema, size)
    test_flops.test_model_flops_match_the_counter(ema)
    test_flops.test_only_attention_layers_have_a_context_term()
    assert (mqar.steps_for(ema), mqar.lr_for(ema), mqar.options_for(ema)) == (mqar.DEFAULT_STEPS, mqar.DEFAULT_LR, {})
    assert demo_lr(ema) == DEFAULT_LR
    jobs = icl.model_jobs([ema], ["minimal", "lm"], [1], [0], 20)
    assert [(job.label, job.block, job.options) for job in jobs] == [(ema, "minimal", {}), (ema, "lm", {})]
    config = yaml.safe_load(paper_sizes.config_text(ema, "145m"))
    assert config["model"]["mixer"] == ema and config["run_dir"] == f"runs/{ema}-145m"


def test_a_throwaway_mixer_plans_and_benchmarks(ema, tmp_path, capsys):
    assert main(["compare", "plan", "--archs", f"attention,{ema}", "--params", "2e5", "--vocab_size", "256",
                 "--dry_run", "true", "--out", str(tmp_path / "plan")]) == 0
    assert f"| {ema} |" in capsys.readouterr().out and not (tmp_path / "plan").exists()
    trained = bench_train(mixers=[ema], d_model=[32], seq_len=[16], n_layers=1, n_heads=2, head_dim=16, batch=2,
                          steps=1, warmup=1)
    assert trained["rows"][0]["status"] == "ok" and trained["rows"][0]["tokens_per_s"] > 0
    rows = bench_mixers(mixers=[ema], lengths=[32], d_model=32, n_heads=2, head_dim=16, memory=False, repeats=1)
    assert rows["rows"][0]["op"] == "diagonal_scan" and rows["rows"][0]["ratio"] > 0


def test_an_unknown_or_mistyped_option_is_one_line_before_anything_is_written(ema, tmp_path, capsys):
    run_dir = tmp_path / "run"
    for options, expected in (({"widht": 2}, "has no option 'widht'; its options: width"),
                              ({"width": "wide"}, "option 'width' must be float, got 'wide'")):
        code = main(["train", "--model.mixer", ema, "--model.mixer_options", json.dumps({ema: options}),
                     "--run_dir", str(run_dir)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and expected in err[0], err
        assert not run_dir.exists()
    with pytest.raises(Exception, match="mixer 'mesa' option 'gamma_init' must be Literal"):
        LMConfig(mixer="mesa", mixer_options={"mesa": {"gamma_init": "wide"}})
    with pytest.raises(Exception, match="multiple of n_kv_heads"):  # what only the constructor knows, at parse time
        LMConfig(n_heads=3, mixer_options={"attention": {"n_kv_heads": 2}})


def test_nothing_below_the_probes_names_a_mixer():
    """`git grep` for each mixer name (as a quoted string) outside lm/mixers, lm/ops, configs, docs and tests, and
    outside the probes, benchmarks, studies and comparisons (lm/eval, lm/bench, lm/research, lm/compare), which keep
    their per-mixer settings keyed by mixer name (docs/design.md, "Layers"); "attention" is allowed as the default
    mixer and the comparison's reference. The model, the accounting and training read the protocol only."""
    names = [name for name in MIXERS if name != "attention"] + ["hawk_mesa", "mesa_attention"]
    pattern = "|".join(rf"[\"']{re.escape(n)}[\"']" for n in names)
    outside = [":!lm/mixers", ":!lm/ops", ":!configs", ":!docs", ":!tests", ":!*.md", ":!lm/eval", ":!lm/bench",
               ":!lm/research", ":!lm/compare"]
    found = subprocess.run(["git", "grep", "--untracked", "-nE", pattern, "--", ".", *outside], cwd=ROOT,
                           capture_output=True, text=True).stdout
    assert found == "", found


def test_a_throwaway_mixer_is_exact_under_context_parallelism(tmp_path):
    """On 4 gloo processes sharing each window (from the third piece on, a rank's entering state goes through the
    transfer maps of the pieces before it), the throwaway mixer, with no transfer map of its own (its op's, found by
    the op's name), gives one process's loss, logits and every gradient, to 1e-10 in float64."""
    import test_context_parallel

    worst = test_context_parallel.compare_on(4, tmp_path / "errors.json", ema_context_worker)["ema"]
    assert len(worst) > 3 and max(worst.values()) <= 1e-10, worst


def test_every_op_has_its_forms_its_transfer_map_and_its_count():
    """What depends on an op alone is found by its name in three tables (docs/design.md, "Op contract")."""
    from lm.ops.call import FORMS
    from lm.ops.flops import COSTS
    from lm.ops.state_transfer import TRANSFERS

    assert set(FORMS) == set(TRANSFERS) == set(COSTS)
    called = {MIXERS[name].planned_call(64, 2, 32, True).op for name in MIXERS if MIXERS[name].recurrent()}
    assert called <= set(FORMS)

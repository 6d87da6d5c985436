"""Each mixer's parameter count (`param_count`, from a build on the meta device) equals the module built on the
CPU, with default and other options; decay parameters are excluded from weight decay; in bf16 the mixers are as close
to float64 as bf16 allows; the model initialises each mixer's own gates once."""

import copy
import math

import pytest
import torch

from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig
from lm.training.module import LMModule
from lm.training.param_groups import decay_groups, param_groups
from lm.training.schedule import OptimConfig

# Options that change a mixer's parameters, beside its defaults; a mixer without an entry is tested at its defaults.
OPTIONS = {
    "attention": [{}, {"n_kv_heads": 2}],
    "mamba2": [{}, {"expand": 1.5, "n_groups": 2, "conv_size": 3}],
    "mlstm": [{}, {"qk_dim_factor": 1.0, "v_dim_factor": 0.5, "conv_size": 4}],
    "deltanet": [{}, {"expand_v": 2.0, "conv_size": 2}],
    "gated_deltanet": [{}, {"expand_v": 1.0}],
    "mesa": [{}, {"expand_v": 2.0, "conv_v": True, "output_gate": True}],
    "swa": [{}, {"window": 5, "n_kv_heads": 2}],
    "gla": [{}, {"expand_v": 1.0, "gate_rank": 8, "conv_size": 4}],
    "hawk": [{}, {"expand": 1.0, "conv_size": 3}],
}


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_parameter_count_equals_the_built_module(name):
    for options in OPTIONS.get(name, [{}]):
        mixer = MIXERS[name](48, 4, 12, 0, **options)
        assert MIXERS[name].param_count(48, 4, 12, **options) == sum(p.numel() for p in mixer.parameters()), options


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_decay_and_gate_parameters_are_not_decayed(name):
    model = LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, head_dim=16, mixer=name))
    groups = {g["name"]: {id(p) for p in g["params"]} for g in param_groups(model, OptimConfig())}
    for pname, p in model.named_parameters():
        if hasattr(p, "decay_group"):  # attention's q/k and v/o matrices: their own decay
            assert id(p) in groups[p.decay_group], pname
        elif getattr(p, "no_weight_decay", False) or p.ndim < 2 or "embed" in pname:
            assert id(p) in groups["no_decay"], pname
        else:
            assert id(p) in groups["decay"], pname


def output_and_input_grad(mixer, x, proj):
    """The mixer's output and the gradient w.r.t. its input of a fixed projection of the output, in float64."""
    x = x.detach().clone().requires_grad_()
    y, _ = mixer(x)
    (y.to(proj.dtype) * proj).sum().backward()
    return y, y.detach().double(), x.grad.double()


def token_errors(a, b):
    """Per-token error ||a_t - b_t|| over the RMS token norm of b: large only where a token is really off."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1).square().mean().sqrt()


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_bf16_forward_and_backward_match_float64(name):
    """A bf16 mixer against the float64 mixer of the same (bf16-rounded) weights, same input and projection: the
    difference is bf16 rounding alone. Measured on 8 seeds: output within 1.2e-2 (relative, whole tensor); input
    gradient within 2.5e-2 on 90% of the tokens, but up to 0.11 on the whole tensor, from a few tokens whose gradient
    is ill-conditioned (a nearly zero key normalised: Mesa's and GLA's first tokens). A wrong result (heads swapped, a
    wrong scale) is off by O(1); Mesa's and mLSTM's gate and state arithmetic done in bf16 rather than float32 (every
    `compute_dtype` returning the input dtype) fails the gradient's, respectively the output's, bound here."""
    torch.manual_seed(0)
    mixer = MIXERS[name](32, 2, 16, 0).to(torch.bfloat16)
    exact = copy.deepcopy(mixer).double()
    x = torch.randn(2, 70, 32).bfloat16()
    proj = torch.randn(2, 70, 32).bfloat16()
    y, out, grad = output_and_input_grad(mixer, x, proj.float())
    _, out_exact, grad_exact = output_and_input_grad(exact, x.double(), proj.double())
    assert y.dtype == torch.bfloat16 and torch.isfinite(out).all() and torch.isfinite(grad).all()
    relative = lambda a, b: ((a - b).norm() / b.norm()).item()
    assert relative(out, out_exact) < 0.025
    assert relative(grad, grad_exact) < 0.25
    assert token_errors(grad, grad_exact).quantile(0.9) < 0.04


@pytest.mark.parametrize("init, memories", [("narrow", [1 + math.exp(3), 1 + math.exp(6)]), ("zero", [2.0, 2.0]),
                                            ("spread", [2.0, 512.0])])
def test_mesa_gate_inits_give_the_memories_they_name(init, memories):
    """gamma at a zero input is sigmoid(bias); the memory 1 / (1 - gamma) of the first and last head."""
    mixer = MIXERS["mesa"](32, 4, 8, 0, gamma_init=init)
    gamma = torch.sigmoid(mixer.gamma_proj.bias.double())
    memory = 1 / (1 - gamma)
    torch.testing.assert_close(memory[[0, -1]], torch.tensor(memories, dtype=torch.float64), rtol=1e-6, atol=0)
    assert (memory.diff() >= 0).all()
    with pytest.raises(ValueError, match="gamma_init"):
        MIXERS["mesa"](32, 4, 8, 0, gamma_init="wide")


@pytest.mark.parametrize("output_gate", [False, True])
def test_mesa_lambda_and_output_norm_start_where_their_options_say(output_gate):
    """lam_init and norm_init (lm research mesa-ablation's settings) set Lambda and the output RMSNorm's weight in a
    model (whose own init leaves both alone); the output then starts at norm_init times the scale it has with 1.
    A lam_init at or below lam_floor, which softplus never reaches, is refused when the options are checked."""
    options = {"output_gate": output_gate}
    build = lambda **extra: LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, head_dim=8,
                                                   mixer="mesa", mixer_options={"mesa": {**options, **extra}}))
    torch.manual_seed(0)
    plain = build(norm_init=1.0)
    torch.manual_seed(0)
    model = build(lam_init=0.3, norm_init=0.125)
    x = torch.randn(2, 9, 32)
    for layer, reference in zip(model.blocks, plain.blocks):
        mixer = layer.mixer
        torch.testing.assert_close(mixer.lam(), torch.full((4, 8), 0.3), rtol=1e-6, atol=0)
        assert (mixer.norm.weight == 0.125).all() and (reference.mixer.norm.weight == 1).all()
        assert torch.equal(reference.mixer.lam(), torch.ones(4, 8))
        mixer.lam_raw.data.copy_(reference.mixer.lam_raw)  # the same solve: only the norm's weight differs
        torch.testing.assert_close(mixer(x)[0], 0.125 * reference.mixer(x)[0], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="lam_init.*must exceed lam_floor"):
        MIXERS["mesa"].check_options({"lam_init": 0.25})
    # Without the RMSNorm (the probes' minimal block) nothing sets the output to unit RMS: its gain stays 1.
    assert (MIXERS["mesa"](32, 4, 8, 0, **options, output_norm=False, norm_init=0.125).norm.weight == 1).all()


def test_the_model_applies_gamma_init_once_and_keeps_the_mixers_gate_biases(monkeypatch):
    """Mesa's gamma_init is applied by its constructor, once per layer: the model's init leaves the biases marked
    own_init (Mesa's gates, mLSTM's) as the constructor set them and applies nothing a second time."""
    import lm.mixers.mesa

    cfg = LMConfig(vocab_size=50, d_model=32, n_layers=4, n_heads=4, head_dim=8, layer_pattern="mesa,mlstm",
                   mixer_options={"mesa": {"gamma_init": "narrow"}})  # its check builds one on the meta device
    calls = []
    original = lm.mixers.mesa.gamma_bias
    monkeypatch.setattr(lm.mixers.mesa, "gamma_bias", lambda *args: calls.append(args) or original(*args))
    model = LanguageModel(cfg)
    assert calls == [("narrow", 4)] * 2
    for mesa, mlstm in (model.blocks[0].mixer, model.blocks[1].mixer), (model.blocks[2].mixer, model.blocks[3].mixer):
        assert torch.equal(mesa.gamma_proj.bias, original("narrow", 4)) and not mesa.beta_proj.bias.any()
        assert torch.equal(mlstm.fgate.bias, torch.linspace(3.0, 6.0, 4)) and (mlstm.igate.bias == -10).all()
        assert abs(mesa.gamma_proj.weight.std().item() - model.cfg.init_std) < 0.005  # the model's init, still


def test_parameter_groups_survive_parameters_that_lose_their_markers():
    """FSDP2's fully_shard replaces each parameter with a new one that has none of the mixers' markers; the groups
    taken from the unsharded model (LMModule does, at construction) still place every parameter by name."""
    cfg = OptimConfig(weight_decay=0.1, qk_weight_decay=0.0, vo_weight_decay=0.05)
    module = LMModule(LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, head_dim=16,
                               layer_pattern="mesa,attention"), cfg, max_steps=10)
    model = module.model
    by_name = lambda groups: {g["name"]: sorted(n for n, p in model.named_parameters()
                                                if any(p is q for q in g["params"])) for g in groups}
    marked = by_name(param_groups(model, cfg))
    groups = decay_groups(model)
    for sub in model.modules():  # what fully_shard does to the parameters, without a process group
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, torch.nn.Parameter(p.detach().clone()))
    assert by_name(param_groups(model, cfg, groups)) == marked
    assert by_name(module.configure_optimizers()["optimizer"].param_groups) == marked
    assert by_name(param_groups(model, cfg)) != marked  # read from the new parameters, the markers are gone
    assert {"qk", "vo", "decay", "no_decay"} <= set(marked) and "blocks.0.mixer.lam_raw" in marked["no_decay"]

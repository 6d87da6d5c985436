"""The mixer protocol (lm.mixers.protocol): a mixer defined here and registered with one line trains, counts its
parameters and FLOPs, plans, benchmarks and keeps the contract like the shipped ones; options are checked at parse
time; and nothing outside lm/mixers and lm/ops names a mixer."""

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_flops import assert_close, counted
from test_mixer_contract import run_in_pieces
from torch import nn

from bench.mixer_speed import bench_mixers
from bench.train_speed import bench_train
from lm.accounting import flops
from lm.cli import main
from lm.mixers import MIXERS, Mixer, register
from lm.mixers.layers import residual_output
from lm.mixers.protocol import OpCall
from lm.model import LanguageModel, LMConfig
from lm.ops import diagonal_scan, diagonal_scan_recurrent

ROOT = Path(__file__).resolve().parents[1]


class EMA(Mixer):
    """A throwaway mixer: an exponential moving average of a projection of the input, h_t = a_t h_{t-1} +
    (1 - a_t) u_t with a data-dependent decay a_t = sigmoid(W_a x_t + b) per channel, then an output projection.
    Parameters: d_model * W (u) + d_model * W + W (the decay) + W * d_model (out), W = width * d_model."""

    @dataclass
    class Options:
        width: float = 1.0

    mqar_steps = 5

    def __init__(self, d_model, n_heads, head_dim, layer_idx=0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        self.W = int(self.options.width * d_model)
        self.u_proj, self.a_proj = nn.Linear(d_model, self.W, bias=False), nn.Linear(d_model, self.W)
        self.o = residual_output(nn.Linear(self.W, d_model, bias=False))  # not named out_proj: the marker counts

    def forward(self, x, state=None, reset=None):
        log_a = F.logsigmoid(self.a_proj(x))
        op = diagonal_scan_recurrent if x.shape[1] == 1 and state is not None else diagonal_scan
        h, state = op(-torch.expm1(log_a) * self.u_proj(x), log_a, initial_state=state, reset=reset)
        return self.o(h.to(x.dtype)), state

    @classmethod
    def param_count(cls, d_model, n_heads, head_dim, **options):
        W = int(cls.check_options(options).width * d_model)
        return 3 * d_model * W + W

    @classmethod
    def op_flops_per_token(cls, d_model, n_heads, head_dim, seq_len, training, **options):
        return 0.0  # the scan is elementwise

    @torch.no_grad()
    def bench_op(self, batch, T):
        log_a = F.logsigmoid(torch.randn(batch, T, self.W))
        return OpCall("diagonal_scan", diagonal_scan, diagonal_scan_recurrent, [torch.randn(batch, T, self.W), log_a],
                      (batch, T, self.W))


@pytest.fixture
def ema():
    register("ema")(EMA)  # the one line that adds a mixer
    yield "ema"
    del MIXERS["ema"]


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
    mixer = EMA(24, 3, 8).double()
    x = torch.randn(2, 17, 24, dtype=torch.float64)
    full, _ = mixer(x)
    torch.testing.assert_close(run_in_pieces(mixer, x, [5, 6, 15]), full, rtol=0, atol=1e-10)
    torch.testing.assert_close(run_in_pieces(mixer, x, range(1, 17)), full, rtol=0, atol=1e-10)


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


def test_nothing_outside_mixers_and_ops_names_a_mixer():
    """`git grep` for each mixer name (as a quoted string or an identifier) outside lm/mixers, lm/ops, configs, docs
    and tests; "attention" is allowed as the default mixer and the comparison's reference."""
    names = [name for name in MIXERS if name != "attention"] + ["hawk_mesa", "mesa_attention"]
    pattern = "|".join(rf"[\"']{re.escape(n)}[\"']" for n in names)
    found = subprocess.run(["git", "grep", "-nE", pattern, "--", ".", ":!lm/mixers", ":!lm/ops", ":!configs", ":!docs",
                            ":!tests", ":!*.md"], cwd=ROOT, capture_output=True, text=True).stdout
    assert found == "", found

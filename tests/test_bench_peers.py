"""lm.bench.peers at a tiny size: the peers build the same models and compute the same mLSTM (no speed is asserted)."""

import json

import pytest
import torch

from lm.bench.mixer_speed import op_inputs
from lm.bench.peers import bench_peers, compare_mlstm, import_peers
from lm.cli import main

TINY = dict(d_model=64, n_layers=2, n_heads=2, head_dim=32, vocab_size=256, seq_len=32, batch=2, steps=1, warmup=1,
            mlstm_lengths=[64, 100], repeats=1,  # 100: a ragged last chunk, which the native peer cannot take as is
            mesa_lengths=[40], mesa_heads=2, mesa_head_dim=8, mesa_batch=1, cg_steps=12)


@pytest.fixture
def one_thread():
    # Two torch threads on a shared 2-core machine spin against other processes; restore the count for later tests.
    threads = torch.get_num_threads()
    yield 1
    torch.set_num_threads(threads)


def test_bench_peers_figures(tmp_path, capsys, one_thread):
    out = tmp_path / "peers.json"
    result = bench_peers(**TINY, threads=one_thread, json_out=str(out))
    g = result["gpt"]
    # Tied embeddings on both sides and no vocabulary padding: the same parameters, exactly (tolerance 0).
    assert g["params_lm"] == g["params_litgpt"] > 0
    assert g["logits_max_abs_diff"] < 1e-4  # the same function (fp32 on CPU) from the same weights
    for key in ("tokens_per_s_lm", "tokens_per_s_litgpt", "lm_vs_litgpt", "flops_per_token"):
        assert g[key] > 0, key
    assert g["lm_vs_litgpt"] == pytest.approx(g["tokens_per_s_lm"] / g["tokens_per_s_litgpt"])
    m = result["mlstm_op"]
    assert (m["K"], m["V"], m["chunk_size"]) == (16, 32, 64)  # d/2 and d split over 2 heads
    assert [r["T"] for r in m["rows"]] == [64, 100]
    for r in m["rows"]:
        assert r["lm_ms"] > 0 and r["native_ms"] > 0
        assert r["lm_vs_native"] == pytest.approx(r["native_ms"] / r["lm_ms"])
        assert r["out_max_abs_diff"] < 1e-5  # float32, outputs of size ~1
        # Gradients differ by O(eps): lm detaches the stabiliser m, the peer differentiates through it.
        assert r["grad_max_abs_diff"] < 1e-3
    mesa = result["mesa_op"]
    assert (mesa["K"], mesa["cg_steps"], [r["T"] for r in mesa["rows"]]) == (8, 12, [40])
    assert mesa["fla"].startswith("not run")  # no CUDA here
    (row,) = mesa["rows"]
    assert row["lm_ms"] > 0 and "fla_ms" not in row
    assert row["exact_residual_max"] < 1e-12 and row["lm_error"] < 1e-5  # float32 CG, 12 steps > K
    assert json.loads(out.read_text()) == result
    printed = capsys.readouterr().out
    assert json.loads(printed[: printed.index("\nGPT training step")]) == result
    assert "| lm / litgpt |" in printed and "| lm speed / native |" in printed and "| lm speed / fla |" in printed


def test_mesa_peer_alone_measures_the_error_of_a_truncated_solve(one_thread):
    # Neither litgpt nor mlstm_kernels is needed for the Mesa comparison; its error is against the float64 solve, so
    # 2 CG steps are measurably worse than 12.
    shape = dict(mesa_lengths=[40], mesa_heads=2, mesa_head_dim=8, repeats=1, threads=one_thread, peers=["fla"])
    short = bench_peers(**shape, cg_steps=2)
    full = bench_peers(**shape, cg_steps=12)
    assert "gpt" not in short and "mlstm_op" not in short and "mesa_op" in short
    assert short["mesa_op"]["rows"][0]["lm_error"] > 100 * full["mesa_op"]["rows"][0]["lm_error"]


def test_mlstm_peers_agree_exactly_in_float64_without_eps():
    # With eps = 0 the stabiliser drops out of the math, so the two are the same function to float64 rounding,
    # gradients included; T = 100 checks the padding of the ragged chunk.
    native = import_peers()[2]
    _, args, proj = op_inputs("mlstm", 100, 64, 2, 0, 1)
    *_, out_diff, grad_diff = compare_mlstm(native, [a.double() for a in args], proj.double(), eps=0.0, chunk_size=64)
    assert out_diff < 1e-12 and grad_diff < 1e-12


def test_cli_bench_peers_is_registered(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "peers", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "--mlstm_lengths" in printed and "--json_out" in printed

"""bench.mixer_speed at tiny sizes: the rows are complete and agree with each other (no speed is asserted)."""

import json
import math

from bench.mixer_speed import bench_mixers

TINY = dict(d_model=32, n_heads=2, head_dim=16, recurrent_max_len=64, repeats=1)
MESA = ["mesa (cg 0)", "mesa (cg 5)", "mesa (cg 10)", "mesa (cg 30)", "mesa (tol 1e-4)"]


def test_rows_are_consistent(tmp_path, capsys):
    out = tmp_path / "mixer.json"
    result = bench_mixers(lengths=[64, 128], memory=False, json_out=str(out), **TINY)
    rows = result["rows"]
    assert [(r["mixer"], r["T"]) for r in rows] == [
        (m, T) for m in ("mamba2", "mlstm", "deltanet", "gated_deltanet", *MESA) for T in (64, 128)]
    ops = {r["mixer"]: r["op"] for r in rows}
    assert ops == {"mamba2": "linear_attention", "mlstm": "mlstm", "deltanet": "delta_rule",
                   "gated_deltanet": "delta_rule", **dict.fromkeys(MESA, "mesa")}
    gated = {r["T"]: r["chunk_ms"] for r in rows if r["mixer"] == "gated_deltanet"}
    for r in rows:
        assert r["chunk_ms"] > 0
        assert r["peak_mib"] is None and r["mib_per_1k_tokens"] is None  # memory=False
        # The recurrent form of mesa only with its default 30 CG steps and no tolerance.
        if r["T"] > TINY["recurrent_max_len"] or r["mixer"] in MESA and r["mixer"] != "mesa (cg 30)":
            assert r["recurrent_ms"] is None and r["ratio"] is None  # never extrapolated
        else:
            assert r["recurrent_ms"] > 0
            assert math.isclose(r["ratio"], r["recurrent_ms"] / r["chunk_ms"])
        if r["op"] == "mesa":
            assert math.isclose(r["vs_gated_deltanet"], r["chunk_ms"] / gated[r["T"]])
        else:
            assert r["cg_iterations"] is None and r["vs_gated_deltanet"] is None
    iterations = {(r["mixer"], r["T"]): r["cg_iterations"] for r in rows if r["op"] == "mesa"}
    for T in (64, 128):
        assert iterations["mesa (cg 0)", T] == 0
        assert 0 < iterations["mesa (cg 5)", T] <= 5
        assert 0 < iterations["mesa (tol 1e-4)", T] <= 30
    assert result["mesa_recurrent_max_len"] == TINY["recurrent_max_len"]  # the smaller of the two limits
    assert json.loads(out.read_text()) == result
    printed = capsys.readouterr().out
    assert json.loads(printed[: printed.index("\n|")]) == result  # JSON first, then the markdown table
    assert printed.count("\n| mamba2 |") == 2 and printed.count("\n| mesa (tol 1e-4) |") == 2
    assert "only at T <= 64" in printed


def test_peak_memory_in_fresh_processes():
    # T=128 and 512, not 64: after the measurement's one-chunk warm-up, a 64-step run allocates less than RSS
    # accounting resolves. Of the mesa rows only the one with the default 30 CG steps is measured.
    result = bench_mixers(mixers=["mamba2", "mesa"], lengths=[128, 512], memory=True, mesa_cg_steps=[5, 30],
                          mesa_cg_tol=None, **TINY)
    rows = {(r["mixer"], r["T"]): r for r in result["rows"]}
    assert list(rows) == [(m, T) for m in ("mamba2", "mesa (cg 5)", "mesa (cg 30)") for T in (128, 512)]
    for (mixer, T), r in rows.items():
        if mixer == "mesa (cg 5)":
            assert r["peak_mib"] is None and r["mib_per_1k_tokens"] is None
            continue
        assert r["peak_mib"] > 0 or mixer == "mesa (cg 30)" and T == 128  # mesa at 128: near RSS resolution
        assert math.isclose(r["mib_per_1k_tokens"], r["peak_mib"] / (T / 1000))

"""lm.bench.mixer_speed at tiny sizes: the rows are complete and agree with each other (no speed is asserted)."""

import json
import math

from lm.bench.mixer_speed import bench_mixer_names, bench_mixers
from lm.mixers import MIXERS

TINY = dict(d_model=32, n_heads=2, head_dim=16, recurrent_max_len=64, repeats=1)
MESA = ["mesa (cg 0)", "mesa (cg 5)", "mesa (cg 10)", "mesa (tol 1e-4)"]


def test_every_mixer_with_a_recurrent_op_is_benchmarked():
    assert bench_mixer_names() == [name for name in MIXERS if name not in ("attention", "swa")]


def test_rows_are_consistent(tmp_path, capsys):
    out = tmp_path / "mixer.json"
    result = bench_mixers(mixers=["gated_deltanet", "gla", "hawk", "mesa"], lengths=[64, 128], memory=False,
                          json_out=str(out), **TINY)
    rows = result["rows"]
    assert [(r["mixer"], r["T"]) for r in rows] == [
        (m, T) for m in ("gated_deltanet", "gla", "hawk", "mesa", *MESA) for T in (64, 128)]
    ops = {r["mixer"]: r["op"] for r in rows}
    assert ops == {"gated_deltanet": "delta_rule", "gla": "linear_attention", "hawk": "diagonal_scan",
                   "mesa": "mesa", **dict.fromkeys(MESA, "mesa")}
    gated = {r["T"]: r["chunk_ms"] for r in rows if r["mixer"] == "gated_deltanet"}
    for r in rows:
        assert r["chunk_ms"] > 0
        assert r["peak_mib"] is None and r["mib_per_1k_tokens"] is None  # memory=False
        # The recurrent form only for the default rows (Mesa's: 30 CG steps, no tolerance).
        if r["T"] > TINY["recurrent_max_len"] or r["mixer"] in MESA:
            assert r["recurrent_ms"] is None and r["ratio"] is None  # never extrapolated
        else:
            assert r["recurrent_ms"] > 0
            assert math.isclose(r["ratio"], r["recurrent_ms"] / r["chunk_ms"])
        if r["op"] == "mesa":
            assert math.isclose(r["vs_reference"], r["chunk_ms"] / gated[r["T"]])
        else:
            assert r["cg_iterations"] is None and r["vs_reference"] is None
    iterations = {(r["mixer"], r["T"]): r["cg_iterations"] for r in rows if r["op"] == "mesa"}
    for T in (64, 128):
        assert iterations["mesa (cg 0)", T] == 0
        assert 0 < iterations["mesa (cg 5)", T] <= 5
        assert 0 < iterations["mesa (tol 1e-4)", T] <= 30
        assert iterations["mesa", T] == 30
    assert json.loads(out.read_text()) == result
    printed = capsys.readouterr().out
    assert json.loads(printed[: printed.index("\n|")]) == result  # JSON first, then the markdown table
    assert printed.count("\n| gla |") == 2 and printed.count("\n| mesa (tol 1e-4) |") == 2


def test_peak_memory_is_tracked_and_grows_with_the_length():
    """Tracked allocations (not RSS): every row has a peak, and four times the tokens hold between 3 and 5 times the
    memory (the ops' memory is linear in T)."""
    result = bench_mixers(mixers=["mamba2", "mesa"], lengths=[128, 512], memory=True, variants=False, **TINY)
    rows = {(r["mixer"], r["T"]): r for r in result["rows"]}
    assert list(rows) == [(m, T) for m in ("mamba2", "mesa") for T in (128, 512)]
    for (_, T), r in rows.items():
        assert r["peak_mib"] > 0
        assert math.isclose(r["mib_per_1k_tokens"], r["peak_mib"] / (T / 1000))
    for mixer in ("mamba2", "mesa"):
        assert 3 < rows[mixer, 512]["peak_mib"] / rows[mixer, 128]["peak_mib"] < 5, mixer


def test_options_apply_to_every_row(monkeypatch):
    seen = []
    real = MIXERS["deltanet"].bench_op
    monkeypatch.setattr(MIXERS["deltanet"], "bench_op", lambda self, *a: seen.append(self.value_dim) or real(self, *a))
    result = bench_mixers(mixers=["deltanet", "gated_deltanet"], lengths=[32], memory=False, options={"expand_v": 1.5},
                          **TINY)
    assert result["options"] == {"expand_v": 1.5} and seen == [24, 24]  # V = 1.5 head_dim, both mixers

"""A run's training FLOPs as spent: a tolerance-stopped Mesa logs (train/flops) the CG steps its telemetry says each
solve ran times the cost of one step, on top of the analytic count; a resumed run goes on counting; `lm compare
report` and the ladder take the logged total as the run's compute. (tests/test_flops.py checks the per-call count
against torch's FLOP counter.)"""

import csv
from pathlib import Path

from strategy_runs import train

from lm.accounting.flops import train_flops_per_token
from lm.compare.ladder_report import spent_compute
from lm.compare.run_results import read_run
from lm.model import LMConfig

D, LAYERS, HEADS, HEAD_DIM, T, CHUNK, BATCH, MOST = 32, 2, 2, 16, 40, 16, 2, 30
MESA = {"chunk_size": CHUNK, "cg_steps": MOST, "cg_tol": 1.0e-2, "backend": "torch"}


def config(tmp: Path, data: str) -> Path:
    path = tmp / "mesa.yaml"
    path.write_text(f"""
seed: 0
model: {{vocab_size: 512, d_model: {D}, n_layers: {LAYERS}, n_heads: {HEADS}, head_dim: {HEAD_DIM}, max_seq_len: {T},
        mixer: mesa, mixer_options: {{mesa: {MESA}}}}}
data: {{path: {data}, seq_len: {T}, micro_batch: {BATCH}, num_workers: 0, val_windows: 2}}
optim: {{lr: 3.0e-3, warmup_steps: 1}}
trainer: {{max_steps: 3, val_every: 1000, ckpt_every: 1000, log_every: 1, progress_bar: false}}
strategy: {{accelerator: cpu}}
""")
    return path


def logged(run: Path) -> dict[int, dict]:
    """Step -> the row of the newest launch that logged train/flops there."""
    rows = {}
    for path in sorted((run / "logs").rglob("metrics.csv")):
        with open(path) as f:
            rows.update({int(r["step"]): r for r in csv.DictReader(f) if r.get("train/flops")})
    return rows


def expected_step_flops(row: dict) -> float:
    """The analytic training count at 30 steps, corrected by each layer's CG steps run, forward and adjoint, each
    costing per (padded) token and head one matvec of the chunked key state, 4 C K + 2 K^2, and its vector work, two
    dot products and three updates, 10 K (lm.ops.flops)."""
    at_most = train_flops_per_token(LMConfig(vocab_size=512, d_model=D, n_layers=LAYERS, n_heads=HEADS,
                                             head_dim=HEAD_DIM, max_seq_len=T, mixer="mesa",
                                             mixer_options={"mesa": {**MESA, "cg_tol": None}}), T)
    padded = -(-T // CHUNK) * CHUNK
    one_step = HEADS * (4 * CHUNK * HEAD_DIM + 2 * HEAD_DIM**2 + 10 * HEAD_DIM) * padded / T
    ran = sum(float(row[f"train/layer{i}/cg_{solve}iterations_run"]) - MOST
              for i in range(LAYERS) for solve in ("", "adjoint_"))
    return BATCH * T * (at_most + ran * one_step)


def test_a_tolerance_stopped_mesa_logs_the_steps_its_solves_ran(kjv_data, tmp_path):
    run = tmp_path / "run"
    train(config(tmp_path, kjv_data), run)
    rows = logged(run)
    assert sorted(rows) == [1, 2, 3]  # train/flops after every optimizer step (log_every 1)
    total = 0.0
    for step in sorted(rows):
        spent = expected_step_flops(rows[step])
        total += spent
        assert abs(float(rows[step]["train/flops"]) / total - 1) < 1e-9, step
        assert float(rows[step]["train/layer0/cg_iterations_run"]) < MOST  # the tolerance stopped it early
    at_most = expected_step_flops({k: MOST for k in rows[1]} | {f"train/layer{i}/cg_{s}iterations_run": MOST
                                                                 for i in range(LAYERS) for s in ("", "adjoint_")})
    assert total < 0.8 * 3 * at_most

    # What the comparisons read: the logged total, and the FLOPs per token it makes.
    results = read_run(str(run))
    assert results.steps == 3 and abs(results.flops / total - 1) < 1e-12 and abs(spent_compute(run) / total - 1) < 1e-12

    # A resumed run goes on counting from the checkpoint's total (here on a longer schedule, said so).
    train(config(tmp_path, kjv_data), run, "--trainer.max_steps", "5", "--trainer.allow_schedule_change", "true")
    rows = logged(run)
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert abs(float(rows[5]["train/flops"]) - total - expected_step_flops(rows[4]) - expected_step_flops(rows[5])) \
        < 1e-9 * total

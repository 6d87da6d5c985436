"""Evaluation results reach the training run's wandb run (offline here) only when the run was trained with wandb."""

import json
import os
from pathlib import Path

from lm.eval.wandb_log import log_to_run


def logged_records(run_dir: Path, run_id: str) -> bytes:
    (record_file,) = run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    return record_file.read_bytes()


def test_eval_results_go_to_the_runs_own_wandb_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer: {wandb: true, wandb_mode: offline, wandb_project: lm-test}\n")
    (run / "wandb_id").write_text("evalrun1\n")
    assert log_to_run(run, "longctx-noise", {"passkey/mean_accuracy": 0.875},
                      [{"probe": "passkey", "length": 256, "accuracy": 0.875}])
    assert "WANDB_SERVICE" not in os.environ  # later subprocesses (a training launch) must not join its service
    records = logged_records(run, "evalrun1")  # the same id as training: resumed, not a new run
    assert b"eval/longctx-noise/passkey/mean_accuracy" in records and b"0.875" in records
    (table,) = run.glob("wandb/offline-run-*/files/media/table/eval/longctx-noise_*.table.json")
    assert json.loads(table.read_text())["data"] == [["passkey", 256, 0.875]]


def test_nothing_is_logged_for_a_run_trained_without_wandb(tmp_path):
    (tmp_path / "config.yaml").write_text("trainer: {wandb: false}\n")
    (tmp_path / "wandb_id").write_text("x\n")
    assert not log_to_run(tmp_path, "ppl-validation", {"ppl_T64": 3.0})
    assert not (tmp_path / "wandb").exists()
    assert not log_to_run(tmp_path / "missing", "ppl-validation", {"ppl_T64": 3.0})

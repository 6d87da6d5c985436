"""A resume with another accumulation (another world size or micro-batch, the same global batch) steps and validates
where an uninterrupted run does: each step takes its whole accumulation, and validation comes on the steps that
trainer.val_every names (lm.training.step_checkpoint.recount_micro_batches). Lightning counts micro-batches, and the
count a checkpoint carries is that of the run that wrote it."""

import csv
import shutil
from pathlib import Path

from strategy_runs import base_config, train_here


def newest_launch(run_dir: Path) -> list[dict]:
    newest = max(run_dir.glob("logs/version_*"), key=lambda p: int(p.name.split("_")[1]))
    with open(newest / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_a_resume_with_another_accumulation_steps_and_validates_on_its_steps(kjv_data, tmp_path):
    config = base_config(tmp_path, kjv_data, steps=4, ckpt_every=1)
    flags = ["--data.global_batch", "2", "--trainer.val_every", "2"]
    first = train_here(config, tmp_path / "first", *flags, "--data.micro_batch", "2", "--trainer.keep_last", "4")
    assert first.returncode == 0, first.stderr[-3000:]  # accumulation 1
    run = tmp_path / "run"  # its step-1 checkpoint, continued with accumulation 2
    (run / "checkpoints").mkdir(parents=True)
    for name in ("step=00000001.ckpt", "step=00000001.ckpt.lm-checkpoint.json"):
        shutil.copy(tmp_path / "first" / "checkpoints" / name, run / "checkpoints")
    resumed = train_here(config, run, *flags, "--data.micro_batch", "1")
    assert resumed.returncode == 0 and "accumulate 2" in resumed.stderr, resumed.stderr[-3000:]
    assert f"resuming from {run / 'checkpoints' / 'step=00000001.ckpt'}" in resumed.stderr
    rows = newest_launch(run)
    assert sorted(int(r["step"]) for r in rows if r.get("val/loss")) == [2, 4]
    # the micro-batches this launch took, by the step they ended: 2 a step
    assert {int(r["step"]): int(r["train/batches"]) for r in rows if r.get("train/batches")} == {2: 2, 3: 4, 4: 6}

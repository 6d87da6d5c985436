"""Evaluation results into the training run's wandb run, when the run was trained with trainer.wandb: same id,
project and mode (offline by default), so a run's evaluations sit beside its training curves."""

import os
from pathlib import Path

import yaml


def log_to_run(run_dir: Path, name: str, metrics: dict[str, float], table: list[dict] | None = None) -> bool:
    """Summary values eval/NAME/METRIC (and a table eval/NAME); False (and nothing logged) unless the run was
    trained with wandb on."""
    config, id_file = run_dir / "config.yaml", run_dir / "wandb_id"
    if not config.is_file() or not id_file.is_file():
        return False
    trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
    if not trainer.get("wandb"):
        return False
    import wandb

    # wandb.init starts a service and names it in os.environ, so that every later child process (a training
    # launch, say) would join it; stop the service again unless this process already had one.
    had_service = "WANDB_SERVICE" in os.environ
    run = wandb.init(project=trainer.get("wandb_project", "lm"), id=id_file.read_text().strip(), resume="allow",
                     dir=str(run_dir), mode=trainer.get("wandb_mode", "offline"))
    try:
        run.summary.update({f"eval/{name}/{key}": value for key, value in metrics.items()})
        if table:
            run.log({f"eval/{name}": wandb.Table(columns=list(table[0]), data=[list(r.values()) for r in table])})
    finally:
        run.finish()
        if not had_service:
            wandb.teardown()
    return True

"""SLURM_RESTART_COUNT (how often the job was requeued) as a metric, so a resumed curve shows its restarts."""

import os

import lightning as L


class LogSlurmRestarts(L.Callback):
    def on_train_start(self, trainer, pl_module):
        if "SLURM_JOB_ID" not in os.environ:
            return
        count = os.environ.get("SLURM_RESTART_COUNT", "0")  # unset before the first requeue
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"slurm/restart_count": int(count)}, step=trainer.global_step)

"""The run's metrics.csv, with one step numbering: the optimizer steps done when a row is written, as the progress
lines, the bar and the checkpoints (step=N.ckpt) count them. Step N's loss and the validation after step N are both on
row N, and a run of N steps ends at row N."""

from lightning.pytorch.loggers import CSVLogger

STEP_KEY, STEPS_DONE = "metrics_step", "optimizer_steps_done"


class StepCSVLogger(CSVLogger):
    """Lightning's CSVLogger, its `step` column the trainer's global_step. Lightning itself logs step N's metrics and
    the validation after it at N - 1 (its count of steps before the one that ends), its ThroughputMonitor at
    micro-batches and validation batches, and lm's callbacks at global_step: every row here gets the same count."""

    trainer = None  # set from the LightningModule that Lightning hands every logger before fitting (log_graph)

    def log_hyperparams(self, params) -> None:
        # hparams.yaml, beside metrics.csv, says which numbering the launch's rows have (logs of older lm have none).
        super().log_hyperparams({**(params if isinstance(params, dict) else vars(params)), STEP_KEY: STEPS_DONE})

    def log_graph(self, model, input_array=None) -> None:
        self.trainer = model.trainer
        super().log_graph(model, input_array)

    def log_metrics(self, metrics, step=None) -> None:
        if self.trainer is not None:
            step = self.trainer.global_step
        super().log_metrics(metrics, step)

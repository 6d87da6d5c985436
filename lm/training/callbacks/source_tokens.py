"""The training tokens each source of a mixture has given so far, logged as data/tokens/NAME.

They are the mixture schedule's counts at the windows consumed (lm.training.mixture), which is what the loaders
read; tests/test_mixture.py checks them against the sources of the windows a run actually trained on."""

import lightning as L


class LogSourceTokens(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        datamodule = trainer.datamodule
        if len(getattr(datamodule, "sources", ())) < 2:
            return  # a single source's tokens are the run's
        # After CountConsumedWindows (listed before this callback), so the counts include this batch.
        for name, tokens in datamodule.tokens_per_source(datamodule.windows_consumed).items():
            pl_module.log(f"data/tokens/{name}", float(tokens))

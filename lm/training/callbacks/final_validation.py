"""A run ends with a validation of its last step: Lightning validates every trainer.val_every steps only, so a run
whose max_steps is not a multiple of val_every would end without one."""

import lightning as L


class FinalValidation(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # At the last optimizer step (not mid-accumulation: global_step counts optimizer steps), should_stop makes
        # Lightning validate once after the step: once also where val_every divides max_steps. A graceful stop at
        # that step skips it (callbacks.graceful_stop).
        if trainer.global_step == trainer.max_steps:
            trainer.should_stop = True

"""The mixers' own statistics while training (each mixer's `metrics()`, e.g. Mesa's forward and adjoint solves),
logged as train/NAME and train/layerI/NAME. (Validation logs them in LMModule.validation_step.)"""

import lightning as L


class MixerMetrics(L.Callback):
    def on_after_backward(self, trainer, pl_module):
        """After the backward, so that what it measured is there too. Tensors, so nothing syncs with the host until a
        log line is written."""
        for key, value in pl_module.model.mixer_metrics().items():
            pl_module.log(f"train/{key}", value)

"""The training FLOPs spent so far, logged as train/flops: every rank's micro-batches, each counted as it ran
(LMModule.flops_per_batch: lm.accounting.flops.flops_spent_per_token, so a tolerance-stopped Mesa counts the CG steps
its telemetry reports). `lm compare report` and the ladder's L(C) read the last value as the run's compute. The total
is kept in the checkpoint, so a resumed run goes on counting."""

import lightning as L
import torch


class SpentFlops(L.Callback):
    def __init__(self):
        self.total = 0.0  # all ranks, the same on every rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        spent = pl_module.flops_per_batch
        if spent is None:
            return
        if trainer.world_size > 1:  # each rank's data stops its solves at its own steps
            spent = float(trainer.strategy.reduce(torch.tensor(spent, dtype=torch.float64, device=pl_module.device),
                                                  reduce_op="sum"))
        self.total += spent
        # float64: a float32 count of 1e18 FLOPs would be off in its eighth digit
        pl_module.log("train/flops", torch.tensor(self.total, dtype=torch.float64, device=pl_module.device),
                      rank_zero_only=True)

    def state_dict(self) -> dict:
        return {"total": self.total}

    def load_state_dict(self, state_dict: dict) -> None:
        self.total = float(state_dict["total"])

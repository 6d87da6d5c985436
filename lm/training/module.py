"""The LightningModule: next-token loss, AdamW groups, the learning-rate schedule, gradient norm."""

import math
from dataclasses import asdict

import lightning as L
import torch

from lm.accounting.flops import flops_spent_per_token
from lm.mixers.context_parallel import join_context_group
from lm.model import LanguageModel, LMConfig
from lm.training.param_groups import decay_groups, param_groups
from lm.training.rng import rng_state, set_rng_state
from lm.training.schedule import OptimConfig, lr_at


def next_token_loss(model: LanguageModel, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting windows[:, 1:] from windows[:, :-1] (float32; the head runs over chunks of
    tokens inside the model's forward, so that FSDP's gathered weights serve it and no [tokens, vocab] logits exist).
    Under context parallelism (model.context), of this rank's piece of the windows: the mean over the group's ranks
    is the windows' loss, and the gradients that DDP or FSDP average over every rank are its gradients."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    if model.context is not None:
        inputs, targets = model.context.piece(inputs), model.context.piece(targets)
    loss, _ = model(inputs, targets=targets)
    return loss


class LMModule(L.LightningModule):
    def __init__(self, model: LMConfig | dict, optim: OptimConfig | dict, max_steps: int,
                 activation_checkpointing: bool = False, compile: bool = False, context_parallel: int = 1):
        super().__init__()
        model = LMConfig(**model) if isinstance(model, dict) else model
        optim = OptimConfig(**optim) if isinstance(optim, dict) else optim
        # Plain dicts, so that a checkpoint loads with torch.load(weights_only=True).
        self.save_hyperparameters({"model": asdict(model), "optim": asdict(optim), "max_steps": max_steps})
        self.model_cfg, self.optim_cfg, self.max_steps = model, optim, max_steps
        self.model = LanguageModel(model)
        self.decay_groups = decay_groups(self.model)  # now: FSDP2's sharded parameters lose the mixers' markers
        self.model.activation_checkpointing = activation_checkpointing
        self.compile_blocks = compile
        self.context_parallel = context_parallel  # ranks that share each window (lm.mixers.context_parallel)
        self.skipped_steps = self.skips_in_a_row = 0  # steps whose gradients were not finite (callbacks.stability)

    batch_shape: tuple[int, int] | None = None  # (micro_batch, seq_len) of this rank, which lm train sets
    _batch_flops: float | None = None  # flops_per_batch of the micro-batch that ran last (each step resets it)
    _batch_windows: int | None = None  # windows in that micro-batch (a validation's last may hold fewer)
    _step_loss: tuple[int, torch.Tensor, int] | None = None  # (optimizer step, sum of micro-batch losses, count)

    @property
    def flops_per_batch(self) -> float | None:
        """FLOPs of this rank's last micro-batch as it ran (lm.accounting.flops.flops_spent_per_token): with its
        backward in training, the forward alone in validation. What Lightning's ThroughputMonitor takes for MFU
        (lm.training.callbacks.throughput) and lm.training.callbacks.spent_flops adds up."""
        if self.batch_shape is None:
            return None
        if self._batch_flops is None:  # once per micro-batch: both readers of it read Mesa's telemetry (a host sync)
            micro_batch, seq_len = self.batch_shape
            windows = self._batch_windows or micro_batch
            # Under context parallelism the group's ranks spend the window's FLOPs together: this rank's share.
            self._batch_flops = (flops_spent_per_token(self.model, seq_len, training=self.training) * windows * seq_len
                                 / self.context_parallel)
        return self._batch_flops

    def setup(self, stage: str) -> None:
        """Context parallelism: join this rank's context group, once the processes are connected."""
        if self.context_parallel > 1 and self.model.context is None:
            self.model.context = join_context_group(self.context_parallel)

    def configure_model(self):
        """FSDP2: one `fully_shard` per block, then the rest; torch.compile per block if asked (after sharding,
        so compiled code sees the sharded parameters). Idempotent: Lightning may call it again."""
        if getattr(self, "_configured", False):
            return
        self._configured = True
        mesh = getattr(self, "device_mesh", None)
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            data_parallel = mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=data_parallel)
            fully_shard(self.model, mesh=data_parallel)
        if self.compile_blocks:
            for block in self.model.blocks:
                block.compile()

    def training_step(self, batch, batch_idx):
        self._batch_flops, self._batch_windows = None, len(batch)
        loss = next_token_loss(self.model, batch)
        self.log_step_loss(loss.detach())
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], prog_bar=True)
        return loss

    def log_step_loss(self, loss: torch.Tensor) -> None:
        """train/loss and train/ppl of the optimizer step, as one process with the whole global batch logs them: the
        mean over every rank (one all-reduce, no host sync; under context parallelism the mean of a window's pieces
        is the window's) and over the step's micro-batches so far. Lightning logs the value of the step's last
        micro-batch, which is then the step's: one run logs the same curve on any world size and accumulation."""
        mean_loss = self.trainer.strategy.reduce(loss, reduce_op="mean")
        step = self.trainer.global_step  # moves after a step's last micro-batch
        if self._step_loss is None or self._step_loss[0] != step:
            self._step_loss = (step, mean_loss, 1)
        else:
            self._step_loss = (step, self._step_loss[1] + mean_loss, self._step_loss[2] + 1)
        step_loss = self._step_loss[1] / self._step_loss[2]
        self.log("train/loss", step_loss, prog_bar=True)
        self.log("train/ppl", torch.exp(step_loss.clamp(max=50.0)))

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self._batch_flops, self._batch_windows = None, len(batch)
        loss = next_token_loss(self.model, batch)
        names = self.source_names
        # A mixture has one loader per source: its metrics are logged per source, its losses at the epoch's end.
        suffix = f"/{names[dataloader_idx]}" if len(names) > 1 else ""
        if suffix:
            self._source_loss[:, dataloader_idx] += torch.stack([loss.detach().float() * len(batch),
                                                                 loss.new_tensor(len(batch), dtype=torch.float32)])
        else:
            self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch.shape[0])
        for key, value in self.model.mixer_metrics().items():
            self.log(f"val/{key}{suffix}", value, sync_dist=True, batch_size=batch.shape[0], add_dataloader_idx=False,
                     reduce_fx="max" if key.endswith("_max") else "mean")

    @property
    def source_names(self) -> list[str]:
        """The names of the data's sources (lm.training.data_module.TokenDataModule); one name for a single source."""
        return getattr(self.trainer.datamodule, "names", [""])

    def on_validation_epoch_start(self):
        self._source_loss = torch.zeros(2, len(self.source_names), device=self.device)  # loss sums; windows

    def on_validation_epoch_end(self):
        names = self.source_names
        if len(names) > 1:
            sums, windows = self.trainer.strategy.reduce(self._source_loss, reduce_op="sum")
            means = sums / windows.clamp(min=1)
            for name, mean in zip(names, means, strict=True):
                self.log(f"val/loss/{name}", mean, sync_dist=False)
            # The mixture's loss: each source's mean, weighted as training draws the sources.
            shares = torch.as_tensor(self.trainer.datamodule.schedule.shares, dtype=means.dtype, device=means.device)
            loss = (shares * means).sum()
            self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        else:
            loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", math.exp(min(float(loss), 50.0)), sync_dist=False)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(param_groups(self.model, self.optim_cfg, self.decay_groups), lr=self.optim_cfg.lr,
                                      betas=self.optim_cfg.betas, eps=self.optim_cfg.eps)
        factor = lambda step: lr_at(step, self.max_steps, self.optim_cfg) / self.optim_cfg.lr  # noqa: E731
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.deepspeed_engine is not None:
            return  # DeepSpeed clips inside its step (gradient_clipping in its config); the norm is logged after it
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        self.log("train/grad_norm", norm)
        # The norm is of the all-reduced gradients, so every rank decides alike. Without gradients, AdamW leaves
        # each parameter and its moments untouched: the step is skipped (lm.training.callbacks.stability).
        if torch.isfinite(norm):
            self.skips_in_a_row = 0
            return
        for parameter in self.parameters():
            parameter.grad = None
        self.skipped_steps += 1
        self.skips_in_a_row += 1

    def on_train_batch_end(self, outputs, batch, batch_idx):
        engine = self.deepspeed_engine
        if engine is not None and self.trainer.global_step != getattr(self, "_norm_logged_at", None):
            self._norm_logged_at = self.trainer.global_step  # an optimizer step happened: log its norm
            if engine.get_global_grad_norm() is not None:
                self.log("train/grad_norm", float(engine.get_global_grad_norm()))

    @property
    def deepspeed_engine(self):
        return getattr(self.trainer.strategy, "deepspeed_engine", None) if self._trainer else None

    def on_save_checkpoint(self, checkpoint):
        checkpoint["rng"] = rng_state()
        checkpoint["stability"] = {"skipped_steps": self.skipped_steps, "skips_in_a_row": self.skips_in_a_row}

    def on_load_checkpoint(self, checkpoint):
        if "rng" in checkpoint:
            set_rng_state(checkpoint["rng"])
        stability = checkpoint.get("stability", {})
        self.skipped_steps = stability.get("skipped_steps", 0)
        self.skips_in_a_row = stability.get("skips_in_a_row", 0)

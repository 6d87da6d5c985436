"""`lm train`: a run directory, a Lightning Trainer, and an exact resume from the newest checkpoint."""

import shutil
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lm.checkpoint import AtomicCheckpointIO, StepCheckpoint, newest_checkpoint
from lm.config import RunConfig
from lm.data import CountConsumedWindows, TokenDataModule
from lm.errors import UserError
from lm.flops import train_flops_per_token
from lm.module import LMModule


class Throughput(ThroughputMonitor):
    """Lightning's tokens/s and FLOP/s monitor, with MFU against a configured peak (dense bf16 989e12 for an
    H100/H200) rather than Lightning's own table, so every architecture is measured against the same peak."""

    def __init__(self, peak_flops: float | None, **kwargs):
        super().__init__(**kwargs)
        self.peak_flops = peak_flops

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        for throughput in self._throughputs.values():
            throughput.available_flops = self.peak_flops or throughput.available_flops


def check_compatible(config: RunConfig, manifest: dict) -> None:
    """The model must cover the tokenizer's vocabulary and the training length."""
    vocab = manifest["tokenizer"]["vocab_size"]
    if config.model.vocab_size < vocab:
        raise UserError(f"vocab mismatch: the tokenizer of {config.data.path} has {vocab} tokens but "
                        f"model.vocab_size is {config.model.vocab_size}")
    if config.data.seq_len > config.model.max_seq_len:
        raise UserError(f"data.seq_len {config.data.seq_len} is larger than model.max_seq_len "
                        f"{config.model.max_seq_len}")


def resolve_resume(run_dir: Path, resume: str) -> str | None:
    """The checkpoint to continue from: 'auto' (newest if any), 'last' (newest, required) or a path."""
    if resume in ("auto", "last"):
        newest = newest_checkpoint(run_dir / "checkpoints")
        if newest is None and resume == "last":
            raise UserError(f"--resume last: no checkpoint in {run_dir / 'checkpoints'}")
        return str(newest) if newest else None
    if not Path(resume).is_file():
        raise UserError(f"--resume: checkpoint {resume} not found")
    return resume


def write_config(run_dir: Path, yaml: str) -> None:
    """config.yaml holds the resolved config of the latest launch; an earlier, different one is kept."""
    path = run_dir / "config.yaml"
    if path.exists() and path.read_text() != yaml:
        path.rename(run_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml")
    path.write_text(yaml)


def build_trainer(config: RunConfig, run_dir: Path) -> L.Trainer:
    t = config.trainer
    on_gpu = t.accelerator == "gpu" or (t.accelerator == "auto" and torch.cuda.is_available())
    precision = t.precision or ("bf16-mixed" if on_gpu else "32-true")
    loggers = [CSVLogger(run_dir, name="logs")]
    if t.wandb:
        id_file = run_dir / "wandb_id"  # the same wandb run across resumes
        if not id_file.exists():
            import wandb

            id_file.write_text(wandb.util.generate_id())
        loggers.append(WandbLogger(project=t.wandb_project, save_dir=run_dir, id=id_file.read_text().strip(),
                                   offline=t.wandb_mode == "offline", resume="allow"))
    tokens = lambda batch: batch.shape[0] * (batch.shape[1] - 1)  # noqa: E731
    callbacks = [CountConsumedWindows(),
                 Throughput(t.peak_flops, batch_size_fn=lambda batch: batch.shape[0], length_fn=tokens,
                            window_size=max(2, t.log_every)),
                 StepCheckpoint(str(run_dir / "checkpoints"), every=t.ckpt_every, keep_last=t.keep_last)]
    return L.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
        precision=precision, max_steps=t.max_steps, accumulate_grad_batches=t.accumulate,
        val_check_interval=t.val_every * t.accumulate, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        log_every_n_steps=t.log_every, logger=loggers, callbacks=callbacks, plugins=[AtomicCheckpointIO()],
        enable_progress_bar=t.progress_bar, default_root_dir=run_dir, enable_model_summary=False,
        # Clipping happens in LMModule.configure_gradient_clipping, which also logs the norm.
        gradient_clip_val=None)


def train(config: RunConfig, resume: str = "auto", yaml: str = "") -> Path:
    """Fit the model of `config`; returns the newest checkpoint."""
    run_dir = Path(config.run_dir)
    L.seed_everything(config.seed, workers=True, verbose=False)
    datamodule = TokenDataModule(config.data)
    check_compatible(config, datamodule.manifest)
    ckpt = resolve_resume(run_dir, resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, yaml)
    tokenizer = Path(config.data.path) / datamodule.manifest["tokenizer"]["file"]
    if not (run_dir / "tokenizer.json").exists():
        shutil.copyfile(tokenizer, run_dir / "tokenizer.json")
    module = LMModule(config.model, config.optim, config.trainer.max_steps)
    module.flops_per_batch = train_flops_per_token(config.model, config.data.seq_len) * \
        config.data.micro_batch * config.data.seq_len
    trainer = build_trainer(config, run_dir)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
    return newest_checkpoint(run_dir / "checkpoints")


def train_from_args(argv: list[str]) -> Path:
    """`lm train`: the run config from YAML + overrides (lm.config), then `train`."""
    from lm.config import parse_run_config

    config, resume, yaml = parse_run_config(argv)
    return train(config, resume, yaml)

"""`lm train`: a run directory, a Lightning Trainer, and an exact resume from the newest checkpoint, built on what the
checks of lm.training.preflight found."""

import dataclasses
import os
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment

from lm.training.callbacks.faults import InjectFaults
from lm.training.callbacks.faults import planned as planned_faults
from lm.training.callbacks.final_validation import FinalValidation
from lm.training.callbacks.graceful_stop import GracefulStop
from lm.training.callbacks.mixer_metrics import MixerMetrics
from lm.training.callbacks.progress import progress_callbacks
from lm.training.callbacks.rank_monitor import RankMonitor
from lm.training.callbacks.run_dir_lock import RunDirLock
from lm.training.callbacks.slurm_restarts import LogSlurmRestarts
from lm.training.callbacks.source_tokens import LogSourceTokens
from lm.training.callbacks.spent_flops import SpentFlops
from lm.training.callbacks.stability import StabilityMonitor
from lm.training.callbacks.throughput import Throughput
from lm.training.checkpoint import newest_checkpoint
from lm.training.checkpoint_io import StreamingCheckpointIO, stream_save
from lm.training.config import RunConfig
from lm.training.console import quiet_known_noise
from lm.training.consolidate import full_checkpoint
from lm.training.data import count_windows
from lm.training.data_module import CountConsumedWindows, TokenDataModule
from lm.training.data_only import reading_data_only
from lm.training.metrics_log import StepCSVLogger
from lm.training.module import LMModule
from lm.training.preflight import Checked, preflight
from lm.training.run_record import launch_entry, record_launch
from lm.training.step_checkpoint import StepCheckpoint
from lm.training.stop_request import StoppedForRequeue
from lm.training.strategy import build_strategy
from lm.util.errors import Diverged, UserError


def mixture_summary(datamodule: TokenDataModule, run_windows: int) -> str:
    """Each source's share, and the epochs of its training split the run will read."""
    parts = []
    for source, stream, windows in zip(datamodule.sources, datamodule.train_streams,
                                       datamodule.schedule.counts(run_windows), strict=True):
        epochs = windows / count_windows(stream.total, datamodule.cfg.seq_len)
        parts.append(f"{source.name} {100 * source.weight:.3g}% ({epochs:.3g} epochs)")
    return "lm train: mixture of " + ", ".join(parts)


def weights_only_checkpoint(checkpoint: Path, config: RunConfig) -> Path:
    """A plain checkpoint next to `checkpoint` with its full weights, its step, data position and RNG, and a
    fresh optimizer state. Written atomically, so ranks that convert at the same time agree."""
    out = checkpoint.parent / "converted" / checkpoint.name
    if out.is_file():
        return out
    full = full_checkpoint(checkpoint)
    module = LMModule(config.model, config.optim, config.trainer.max_steps)
    full["optimizer_states"] = [module.configure_optimizers()["optimizer"].state_dict()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    stream_save(full, tmp)
    os.replace(tmp, out)
    return out


def write_config(run_dir: Path, yaml: str) -> None:
    """config.yaml holds the resolved config of the latest launch; an earlier, different one is kept."""
    path = run_dir / "config.yaml"
    if path.exists() and path.read_text() != yaml:
        path.rename(run_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml")
    path.write_text(yaml)


def wandb_run_id(run_dir: Path) -> str:
    """The run directory's wandb id, made once, so every resume and requeue logs to the same wandb run. Ranks
    start together: the first to link its id into place wins and every rank reads that one."""
    id_file = run_dir / "wandb_id"
    if not id_file.exists():
        tmp = run_dir / f"wandb_id.{os.getpid()}.tmp"
        tmp.write_text(uuid.uuid4().hex[:12])
        try:
            os.link(tmp, id_file)
        except FileExistsError:
            pass
        tmp.unlink()
    return id_file.read_text().strip()


def build_trainer(config: RunConfig, run_dir: Path, stop: GracefulStop, stability: StabilityMonitor,
                  accumulate: int, extra_callbacks: Sequence[L.Callback] = ()) -> L.Trainer:
    """The Trainer of `config`, with training's own callbacks and then the caller's (the side concerns that build on
    training, such as in-loop evaluation)."""
    t, st = config.trainer, config.strategy
    loggers = [StepCSVLogger(run_dir, name="logs")]
    if t.wandb:
        loggers.append(WandbLogger(project=t.wandb_project, save_dir=run_dir, id=wandb_run_id(run_dir),
                                   offline=t.wandb_mode == "offline", resume="allow"))
    # This rank's tokens: a context group's ranks share their windows, each holding a 1/context_parallel piece.
    pieces = st.context_parallel
    tokens = lambda batch: batch.shape[0] * (batch.shape[1] - 1) // pieces  # noqa: E731
    # What a step's checkpoint must hold of the step (its windows, its FLOPs) is counted before a stop can save one.
    callbacks = [RunDirLock(run_dir), LogSlurmRestarts(), CountConsumedWindows(), LogSourceTokens(), SpentFlops(), stop,
                 FinalValidation(), stability, MixerMetrics(),
                 Throughput(t.peak_flops, pieces, tokens, window_size=max(2, t.log_every)),
                 StepCheckpoint(str(run_dir / "checkpoints"), every=t.ckpt_every, keep_last=t.keep_last),
                 *progress_callbacks(t.progress_bar, t.log_every, tokens)]
    if t.rank_every:
        callbacks.append(RankMonitor(t.rank_every))
    callbacks += extra_callbacks
    if faults := planned_faults():  # tests only: LM_FAULTS (lm.training.callbacks.faults)
        callbacks.append(InjectFaults(faults))
    # lm handles SIGUSR1 itself (GracefulStop); Lightning's SLURM requeue would race with it.
    plugins = [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []
    plugins.append(StreamingCheckpointIO())  # single files: one streamed write, weights-only reads
    return L.Trainer(
        accelerator=st.accelerator, devices=st.devices, num_nodes=st.num_nodes,
        strategy=build_strategy(st, config.optim.grad_clip, config.data.micro_batch),
        precision=st.resolved_precision, max_steps=t.max_steps, accumulate_grad_batches=accumulate,
        val_check_interval=t.val_every * accumulate, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        limit_val_batches=0 if config.data.val_windows == 0 else None,  # data.val_windows 0: no validation at all
        log_every_n_steps=t.log_every, logger=loggers, callbacks=callbacks, plugins=plugins,
        enable_progress_bar=any(isinstance(c, ProgressBar) for c in callbacks),  # none: lines, not a bar
        default_root_dir=run_dir, enable_model_summary=False,
        # Clipping happens in LMModule.configure_gradient_clipping, which also logs the norm.
        gradient_clip_val=None)


def train(config: RunConfig, resume: str = "auto", yaml: str = "", callbacks: Sequence[L.Callback] = (),
          checked: Checked | None = None) -> Path:
    """Fit the model of `config`; returns the newest checkpoint. `callbacks` are the caller's side concerns: in-loop
    evaluation (the config's `eval` section) builds on training, so `lm train` (lm.cli.train) passes it here.
    `checked`: what lm.training.preflight found for this config and resume, where the caller has run it (`lm train`
    does, before it imports Lightning); else it runs here."""
    if config.eval.every and not any(getattr(c, "evaluates_in_loop", False) for c in callbacks):
        raise UserError("eval.every is set, but in-loop evaluation was not given: run `lm train`, or pass "
                        "lm.eval.in_loop.in_loop_callbacks(config)")
    quiet_known_noise()  # Lightning's banners and tips, known deprecations (lm.training.console)
    # LMModule skips its clipping hook under DeepSpeed, which clips in its own step: Lightning's warning is moot.
    warnings.filterwarnings("ignore", message="Since DeepSpeed handles gradient clipping")
    # Lightning's hint to use srun whenever srun exists is noise off SLURM; launch_guard checks real SLURM launches.
    warnings.filterwarnings("ignore", message="The `srun` command is available")
    # Every check, before anything is written (lm.training.preflight).
    checked = checked or preflight(config, resume)
    config, checkpoint = checked.config, checked.checkpoint
    replicas, accumulate, global_batch = checked.replicas, checked.accumulate, checked.global_batch
    run_dir = Path(config.run_dir)
    L.seed_everything(config.seed, workers=True, verbose=False)
    # The shards' sha256 were checked by preflight: once is enough.
    datamodule = TokenDataModule(dataclasses.replace(config.data, verify=False), config.strategy.context_parallel)
    ckpt_path = None
    if checkpoint is not None:  # a copy of its weights alone where this strategy cannot carry its optimizer state
        ckpt_path = str(weights_only_checkpoint(checkpoint, config) if checked.weights_only else checkpoint)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, yaml)
    tokenizer = Path(config.data.first_path) / datamodule.manifest["tokenizer"]["file"]
    if not (run_dir / "tokenizer.json").exists():
        shutil.copyfile(tokenizer, run_dir / "tokenizer.json")
    pieces = config.strategy.context_parallel
    module = LMModule(config.model, config.optim, config.trainer.max_steps,
                      config.trainer.activation_checkpointing, config.trainer.compile, pieces)
    module.batch_shape = (config.data.micro_batch, config.data.seq_len)
    if config.strategy.resolved_precision == "64-true":
        # Lightning restores a checkpoint's weights before its precision converts the module: a float32 module would
        # round the float64 weights it resumes from.
        module.double()
    stop, stability = GracefulStop(), StabilityMonitor(config.trainer.stop_after_skips)
    trainer = build_trainer(config, run_dir, stop, stability, accumulate, callbacks)
    if trainer.is_global_zero:
        # What made this launch, before it trains (lm.training.run_record): a reported number can be traced to it.
        # An allowed change of the schedule (trainer.allow_schedule_change) is noted there too.
        note = {"schedule_change": checked.schedule_change} if checked.schedule_change else None
        record_launch(run_dir, launch_entry(config.strategy.accelerator, [s.path for s in datamodule.sources],
                                            checkpoint, config.strategy.world_size, note=note))
        # the model as built: a hybrid's mix shows here (a cut pattern would have)
        print(f"lm train: {module.model.num_params():,} parameters; {config.model.layer_summary()}", file=sys.stderr)
        context = f" (context parallel: {pieces} processes share each window)" if pieces > 1 else ""
        print(f"lm train: {replicas} processes{context} x micro_batch {config.data.micro_batch} x accumulate "
              f"{accumulate} = {global_batch} sequences ({global_batch * config.data.seq_len:,} tokens) per step",
              file=sys.stderr)
        if len(datamodule.sources) > 1:
            print(mixture_summary(datamodule, config.trainer.max_steps * global_batch), file=sys.stderr)
        if checkpoint is not None:  # says which checkpoint this launch continues, so a log shows every resume
            print(f"lm train: resuming from {checkpoint}", file=sys.stderr)
        if "SLURM_JOB_ID" in os.environ:
            print(f"lm train: SLURM job {os.environ['SLURM_JOB_ID']}, restart "
                  f"{os.environ.get('SLURM_RESTART_COUNT', 0)}", file=sys.stderr)
    with reading_data_only():  # Lightning's, DeepSpeed's and DCP's own reads of the checkpoint too
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    if stability.diverged_at is not None:
        raise Diverged(f"stopped at step {stability.diverged_at}: the gradients of {config.trainer.stop_after_skips} "
                       "steps in a row were not finite (each was skipped); a checkpoint of that step is in "
                       f"{run_dir / 'checkpoints'}")
    if stop.stopped:
        raise StoppedForRequeue(trainer.global_step)
    return newest_checkpoint(run_dir / "checkpoints")

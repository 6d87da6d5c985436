"""The training run's configuration: dataclasses read from YAML + command-line overrides by jsonargparse.

Without torch: this module and what it imports at its top (tests/test_layers.py) check a config everywhere that needs
no torch, so that a mistake in it (an unknown key, a wrong type, an unknown mixer or mixer option) ends in one line
before torch's import, which costs a process seconds; the check that does need it (each mixer built on the meta
device, lm.model_config) follows once the whole config has passed (parse_run_config)."""

from dataclasses import dataclass, field
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentParser

from lm.model_config import LMConfig, mixers_built_later
from lm.training.data_config import DataConfig
from lm.training.schedule import OptimConfig
from lm.training.strategy_config import StrategyConfig
from lm.util.config_errors import check_config_files, error_line
from lm.util.errors import UserError


@dataclass
class TrainerConfig:
    """How the run is driven (Lightning Trainer settings).

    Args:
        max_steps: Optimizer steps of the whole run (the schedule's length).
        accumulate: Micro-batches per optimizer step; None: from data.global_batch and the world size (given
            with a global batch, it is checked).
        val_every: Validate every this many optimizer steps.
        ckpt_every: Checkpoint every this many optimizer steps (and at the end).
        keep_last: Checkpoints kept (-1: all); older ones are deleted once a newer one is complete.
        log_every: Log every this many optimizer steps.
        activation_checkpointing: Recompute each block in the backward pass (less memory, ~1/3 more compute).
        compile: torch.compile each block.
        progress_bar: Show progress: a bar on a terminal, else a plain line every log_every steps.
        peak_flops: Peak FLOP/s of one device, for MFU (None: no MFU logged).
        wandb: Also log to Weights & Biases.
        wandb_project: Its project.
        wandb_mode: "offline" (default: nothing leaves the machine) or "online".
        rank_every: Log the effective rank of each attention layer's W_Q^T W_K and W_O W_V products (mean over
            heads) every this many optimizer steps (0: never; lm.training.callbacks.rank_monitor).
        stop_after_skips: Steps with non-finite gradients are skipped (callbacks/stability.py); this many in a
            row stop the run with a checkpoint.
        allow_schedule_change: Resume from a checkpoint trained under another learning-rate schedule (max_steps, or
            optim's lr, schedule, warmup_steps, init_lr, min_lr_ratio, decay_fraction), which is otherwise refused;
            the run's record notes the change (lm.training.schedule_change).
    """

    max_steps: int = 1000
    accumulate: int | None = None
    val_every: int = 200
    ckpt_every: int = 200
    keep_last: int = 3
    log_every: int = 10
    activation_checkpointing: bool = False
    compile: bool = False
    progress_bar: bool = True
    peak_flops: float | None = None
    wandb: bool = False
    wandb_project: str = "lm"
    wandb_mode: str = "offline"
    rank_every: int = 0
    stop_after_skips: int = 5
    allow_schedule_change: bool = False

    def __post_init__(self):
        at_least("trainer.stop_after_skips", self.stop_after_skips, 1)
        for name in ("max_steps", "val_every", "ckpt_every", "log_every"):
            at_least(f"trainer.{name}", getattr(self, name), 1)
        if self.keep_last != -1:  # 0 would keep none: nothing to resume from
            at_least("trainer.keep_last", self.keep_last, 1)
        if self.accumulate is not None:
            at_least("trainer.accumulate", self.accumulate, 1)
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise UserError(f"trainer.peak_flops must be positive (or null: no MFU), got {self.peak_flops}")
        if self.wandb_mode not in ("offline", "online"):
            raise UserError(f"trainer.wandb_mode must be offline or online, not {self.wandb_mode!r}")
        if self.rank_every < 0:
            raise UserError(f"trainer.rank_every must be 0 (off) or positive, got {self.rank_every}")


@dataclass
class InLoopEvalConfig:
    """Evaluation of the current weights during training (OLMo-core's DownstreamEvaluator, gpt-neox's eval_tasks).

    By lm/eval/in_loop.py; its results are logged beside the loss as eval/TASK/METRIC.

    Args:
        every: Evaluate every this many optimizer steps (0: never).
        tasks: lm-eval task names: lm-eval's own, or local YAMLs under include_path (which work offline).
        include_path: A folder of lm-eval task YAMLs.
        limit: Examples per task (None: all).
        probes: Long-context probes generated here (lm.eval.longctx: passkey, single, multikey, multivalue, mqar, vt),
            evaluated as lm-eval tasks at probe_length tokens.
        probe_length: Prompt length of the probes, in tokens.
        probe_samples: Examples per probe.
        batch_size: Sequences per forward pass.
    """

    every: int = 0
    tasks: list[str] = field(default_factory=list)
    include_path: str | None = None
    limit: int | None = None
    probes: list[str] = field(default_factory=list)
    probe_length: int = 256
    probe_samples: int = 8
    batch_size: int = 4

    def __post_init__(self):
        at_least("eval.every", self.every, 0)
        for name in ("probe_length", "probe_samples", "batch_size"):
            at_least(f"eval.{name}", getattr(self, name), 1)
        if self.limit is not None:
            at_least("eval.limit", self.limit, 1)
        if self.every and not (self.tasks or self.probes):
            raise UserError("eval.every is set but there is nothing to evaluate: give eval.tasks or eval.probes")
        if self.include_path is not None and not Path(self.include_path).is_dir():
            raise UserError(f"eval.include_path {self.include_path} is not a folder")
        probes = ("passkey", "single", "multikey", "multivalue", "mqar", "vt")  # lm.eval.longctx.probes.PROBES
        if unknown := [p for p in self.probes if p not in probes]:
            raise UserError(f"eval.probes: unknown {', '.join(unknown)}; known: {', '.join(probes)}")


@dataclass
class RunConfig:
    """Everything a training run needs; `lm train --print_config` shows it resolved."""

    model: LMConfig = field(default_factory=LMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    eval: InLoopEvalConfig = field(default_factory=InLoopEvalConfig)
    run_dir: str = "runs/default"
    seed: int = 0

    def __post_init__(self):
        check_data(self.data)
        if self.data.seed is None:  # the data order follows the run's seed unless fixed (lm.training.data)
            self.data.seed = self.seed
        if Path(self.run_dir).exists() and not Path(self.run_dir).is_dir():
            raise UserError(f"run_dir {self.run_dir} is a file, not a directory")


def at_least(name: str, value: int, least: int) -> None:
    if value < least:
        raise UserError(f"{name} must be at least {least}, got {value}")


def check_data(d: DataConfig) -> None:
    """The data section's sizes, which DataConfig (training/data_config.py) leaves unchecked; a zero micro-batch would
    otherwise fail only inside the first training step, after the run directory is written."""
    for name in ("seq_len", "micro_batch"):
        at_least(f"data.{name}", getattr(d, name), 1)
    for name in ("global_batch", "global_batch_tokens"):
        if getattr(d, name) is not None:
            at_least(f"data.{name}", getattr(d, name), 1)
    at_least("data.num_workers", d.num_workers, 0)


def train_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="lm train", exit_on_error=False, default_env=False, allow_abbrev=False,
                            description="Train a language model from a YAML config with command-line overrides.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file(s) with the settings below.")
    parser.add_class_arguments(RunConfig, nested_key=None, fail_untyped=True)
    parser.add_argument("--resume", type=str, default="auto",
                        help="'auto': continue from the newest checkpoint of run_dir if there is one; "
                             "'last': the same, but there must be one; or a checkpoint path.")
    return parser


def parse_run_config(argv: list[str]) -> tuple[RunConfig, str, str]:
    """(config, resume, resolved YAML) from `lm train` arguments; bad input raises UserError."""
    check_config_files(argv)  # a YAML syntax error names its file and line
    with mixers_built_later():  # jsonargparse makes the default LMConfig here
        parser = train_parser()
    try:
        with mixers_built_later():  # every check that needs no torch, over the whole config, first
            namespace = parser.parse_args(argv)
            run = parser.instantiate(namespace)
        run.model.check_mixers()  # then the mixers built on the meta device, which imports torch
    except UserError:
        raise
    except Exception as err:  # jsonargparse reports every bad key, type and file as an exception
        cause = err.__cause__ or err.__context__
        raise UserError(str(cause) if isinstance(cause, UserError) else error_line(parser, err)) from None
    resume = namespace.pop("resume")
    if resume not in ("auto", "last") and not Path(resume).exists():  # before lm train creates the run directory
        raise UserError(f"--resume: checkpoint {resume} not found")
    namespace.pop("config", None)
    yaml = parser.dump(namespace, skip_none=False)
    config = RunConfig(model=run.model, data=run.data, optim=run.optim, trainer=run.trainer,
                       strategy=run.strategy, eval=run.eval, run_dir=run.run_dir, seed=run.seed)
    return config, resume, yaml


def check_mixer_options(model: LMConfig) -> None:
    """Options for a mixer the model does not use are a mistake in a run (a Mesa option on a Gated DeltaNet run would
    otherwise be ignored without a word), wherever they were given; `lm train` checks (launch_guard.check_launch). A
    base config that `lm compare` shapes for several mixers may hold them all."""
    if unused := model.unused_mixer_options():
        raise UserError(f"model.mixer_options.{unused[0]}: the model does not use {unused[0]} (its mixers: "
                        f"{', '.join(dict.fromkeys(model.layer_mixers()))})")

"""The training run's configuration: dataclasses read from YAML + command-line overrides by jsonargparse."""

from dataclasses import dataclass, field

from jsonargparse import ActionConfigFile, ArgumentParser

from lm.config_errors import error_line
from lm.data import DataConfig
from lm.errors import UserError
from lm.model import LMConfig
from lm.schedule import OptimConfig
from lm.strategy import StrategyConfig


@dataclass
class TrainerConfig:
    """How the run is driven (Lightning Trainer settings).

    Args:
        max_steps: Optimizer steps of the whole run (the schedule's length).
        accumulate: Micro-batches per optimizer step; None: from data.global_batch and the world size (given
            with a global batch, it is checked).
        val_every: Validate every this many optimizer steps.
        ckpt_every: Checkpoint every this many optimizer steps (and at the end).
        keep_last: Checkpoints kept; older ones are deleted once a newer one is complete.
        log_every: Log every this many optimizer steps.
        activation_checkpointing: Recompute each block in the backward pass (less memory, ~1/3 more compute).
        compile: torch.compile each block.
        progress_bar: Show Lightning's progress bar.
        peak_flops: Peak FLOP/s of one device, for MFU (None: no MFU logged).
        wandb: Also log to Weights & Biases.
        wandb_project: Its project.
        wandb_mode: "offline" (default: nothing leaves the machine) or "online".
        rank_every: Log the effective rank of each attention layer's W_Q^T W_K and W_O W_V products (mean over
            heads) every this many optimizer steps (0: never; lm.rank_monitor).
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

    def __post_init__(self):
        if self.rank_every < 0:
            raise UserError(f"trainer.rank_every must be 0 (off) or positive, got {self.rank_every}")


@dataclass
class RunConfig:
    """Everything a training run needs; `lm train --print_config` shows it resolved."""

    model: LMConfig = field(default_factory=LMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    run_dir: str = "runs/default"
    seed: int = 0


def train_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="lm train", exit_on_error=False, default_env=False,
                            description="Train a language model from a YAML config with command-line overrides.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file(s) with the settings below.")
    parser.add_class_arguments(RunConfig, nested_key=None, fail_untyped=True)
    parser.add_argument("--resume", type=str, default="auto",
                        help="'auto': continue from the newest checkpoint of run_dir if there is one; "
                             "'last': the same, but there must be one; or a checkpoint path.")
    return parser


def parse_run_config(argv: list[str]) -> tuple[RunConfig, str, str]:
    """(config, resume, resolved YAML) from `lm train` arguments; bad input raises UserError."""
    parser = train_parser()
    try:
        namespace = parser.parse_args(argv)
        run = parser.instantiate(namespace)
    except UserError:
        raise
    except Exception as err:  # jsonargparse reports every bad key, type and file as an exception
        cause = err.__cause__ or err.__context__
        raise UserError(str(cause) if isinstance(cause, UserError) else error_line(parser, err)) from None
    resume = namespace.pop("resume")
    namespace.pop("config", None)
    yaml = parser.dump(namespace, skip_none=False)
    config = RunConfig(model=run.model, data=run.data, optim=run.optim, trainer=run.trainer,
                       strategy=run.strategy, run_dir=run.run_dir, seed=run.seed)
    return config, resume, yaml

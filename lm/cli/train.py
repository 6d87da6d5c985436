"""`lm train`: the run config from YAML + overrides (lm.training.config), then training with the side concerns that
build on it and that training itself does not import: in-loop evaluation (lm.eval.in_loop)."""

from pathlib import Path

from lm.eval.in_loop import in_loop_callbacks
from lm.training.config import parse_run_config
from lm.training.train import train


def train_from_args(argv: list[str]) -> Path:
    config, resume, yaml = parse_run_config(argv)
    return train(config, resume, yaml, callbacks=in_loop_callbacks(config))

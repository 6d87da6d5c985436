"""`lm train`: the run config from YAML + overrides (lm.training.config, before torch is imported) and every check of
the launch (lm.training.preflight) before Lightning, DeepSpeed or transformers are imported, so that a mistake costs
a second or two; then training with the side concerns that build on it and that training itself does not import:
in-loop evaluation (lm.eval.in_loop)."""

from pathlib import Path

from lm.training.config import parse_run_config


def train_from_args(argv: list[str]) -> Path:
    config, resume, yaml = parse_run_config(argv)
    # torch only now that the config has parsed: the checks of the data and the checkpoint read tensors
    from lm.training.preflight import preflight

    checked = preflight(config, resume)
    # Lightning (and with it torchmetrics, transformers, torch._dynamo) only now that the launch is known to be good.
    from lm.eval.in_loop import in_loop_callbacks
    from lm.training.train import train

    return train(checked.config, resume, yaml, callbacks=in_loop_callbacks(checked.config), checked=checked)

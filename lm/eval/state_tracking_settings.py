"""The settings of `lm eval state-tracking`: one dataclass, whose defaults are the quick probe, and the presets that
replace them (configs/state_tracking/NAME.yaml, `--preset NAME`; `papers` follows the negative-eigenvalue and
DeltaProduct papers, scaled down where a CPU forces it, docs/state_tracking.md).

The doc's table of a preset is `settings_table`, so that the doc and the file cannot drift apart
(tests/test_state_tracking.py)."""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lm.util.errors import UserError
from lm.util.output import markdown_table
from lm.util.resources import shipped

# The quick probe's models: the delta rules with beta in [0, 1] and in [0, 2], the Householder products of
# DeltaProduct (with its paper's beta in [0, 2]), and their neighbours.
QUICK_MODELS = ["attention", "mamba2", "mlstm", "deltanet", "deltanet@beta_range=[0,2]", "gated_deltanet",
                "gated_deltanet@beta_range=[0,2]", "gated_deltaproduct@householder_steps=2@beta_range=[0,2]",
                "gated_deltaproduct@householder_steps=3@beta_range=[0,2]", "kda", "mesa"]


@dataclass(frozen=True)
class Settings:
    """What `lm eval state-tracking` trains.

    Attributes:
        models: Task -> its models: mixers or variants "mixer@option=value@..." (values as JSON), "@layers=N" for a
            depth other than n_layers.
        max_steps: Task -> the most training steps of a run (it stops once it has solved the training length).
        options: Task -> mixer options given to each of its models whose mixer has them (a model's own win).
        lrs: Peak learning rates. More than one: each (task, model) trains every lr at sweep_seed first, and its
            seeds at the best (the sweep's runs are not seeds). One: the seeds train at it.
        sweep_seed: The seed of the lr sweep's runs.
        seeds: The seeds reported, each a fresh run at the chosen lr.
        length: Training length (words of this many elements).
        batch: Words per step (fresh words every step).
        d_model: Width.
        n_layers: Layers (a model's "@layers=N" replaces it).
        n_heads: Heads.
        head_dim: Key size per head.
        mlp_ratio: SwiGLU hidden width over d_model.
        warmup: Share of max_steps of linear warmup, then a cosine decay to zero at max_steps.
        weight_decay: AdamW's.
        grad_clip: Gradient norm clip; None: none.
        eval_every: Steps between two points of the learning curve (training loss, validation accuracy).
        val_words: Validation words at the training length, drawn once from a seed of their own.
        solved_at: A run stops once this share of the validation words is right at every position.
        test_words: Test words of the longest multiple, fresh, scored at every position.
        multiples: Test lengths, as multiples of the training length.
    """

    models: dict[str, list[str]] = field(default_factory=lambda: {t: QUICK_MODELS for t in ("parity", "s3", "s5")})
    max_steps: dict[str, int] = field(default_factory=lambda: {"parity": 600, "s3": 600, "s5": 600})
    options: dict[str, dict] = field(default_factory=dict)
    lrs: list[float] = field(default_factory=lambda: [3e-3])
    sweep_seed: int = 0
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    length: int = 32
    batch: int = 64
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 2
    head_dim: int = 16
    mlp_ratio: float = 2.0
    warmup: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    eval_every: int = 100
    val_words: int = 256
    solved_at: float = 0.99
    test_words: int = 256
    multiples: list[int] = field(default_factory=lambda: [1, 2, 4])

    def run_shape(self, task: str) -> dict:
        """What a run of `task` trains with, besides its model, seed and lr (a saved run is reused only if equal)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("models", "max_steps", "options", "lrs", "sweep_seed", "seeds")}
        return {**shared, "max_steps": self.max_steps[task], "options": self.options.get(task, {})}


def preset_path(name: str) -> Path:
    return shipped(f"configs/state_tracking/{name}.yaml")


def presets() -> list[str]:
    return sorted(p.stem for p in shipped("configs/state_tracking").glob("*.yaml"))


def load_preset(name: str | None) -> Settings:
    """The settings of preset `name` (configs/state_tracking/NAME.yaml: fields of Settings); None: the defaults."""
    if name is None:
        return Settings()
    path = preset_path(name)
    if not path.is_file():
        raise UserError(f"--preset: no preset {name!r}; known: {', '.join(presets()) or 'none'}")
    raw = yaml.safe_load(path.read_text()) or {}
    known = {f.name for f in dataclasses.fields(Settings)}
    if unknown := sorted(set(raw) - known):
        raise UserError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return Settings(**raw)


def overridden(settings: Settings, tasks: list[str] | None, models: list[str] | None, steps: int | None,
               **scalars) -> Settings:
    """`settings` with the command line's choices: a subset of its tasks, one model list for every task, one step
    budget for every task, and any other setting given (None: the preset's)."""
    chosen = {k: v for k, v in scalars.items() if v is not None}
    task_names = list(settings.models) if tasks is None else tasks
    for task in task_names:
        if task not in settings.models and (models is None or steps is None):
            raise UserError(f"--tasks: {task} is not in this preset's tasks ({', '.join(settings.models)}); give "
                            f"--models and --steps for it")
    return dataclasses.replace(
        settings, **chosen, options={t: o for t, o in settings.options.items() if t in task_names},
        models={t: settings.models[t] if models is None else models for t in task_names},
        max_steps={t: settings.max_steps[t] if steps is None else steps for t in task_names})


def settings_table(settings: Settings) -> str:
    """The settings as the doc shows them: one row per setting (the models per task, then the rest)."""
    rows = [[f"models ({task}, {len(models)})", ", ".join(f"`{m}`" for m in models)]
            for task, models in settings.models.items()]
    rows += [["max_steps", ", ".join(f"{task} {steps}" for task, steps in settings.max_steps.items())]]
    rows += [[f"options ({task})", ", ".join(f"{k}: {v}" for k, v in options.items())]
             for task, options in settings.options.items()]
    rows += [[f.name, str(getattr(settings, f.name))] for f in dataclasses.fields(settings)
             if f.name not in ("models", "max_steps", "options")]
    return markdown_table(["setting", "value"], rows)


def write_table(name: str) -> None:
    """Print preset `name`'s table (for docs/state_tracking.md): `python -m lm.eval.state_tracking_settings papers`."""
    print(settings_table(load_preset(name)), end="")


if __name__ == "__main__":
    import sys

    write_table(sys.argv[1])

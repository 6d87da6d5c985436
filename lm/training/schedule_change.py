"""A resume continues the learning-rate schedule its checkpoint was trained under. The schedule (lm.training.schedule's
lr_at) is a function of the run's length and the optim settings it reads: another max_steps stretches the cosine
under the steps already taken, another lr or warmup moves the rate at the resumed step, without a word. So `lm train`
refuses a resume whose schedule differs from the checkpoint's, unless trainer.allow_schedule_change says so; then the
run's record (lm.training.run_record) notes the change.

The schedule a checkpoint was trained under is the one it holds itself (its hyperparameters, which every strategy's
checkpoint carries): the run directory's config.yaml is the latest launch's, which may have ended before it wrote a
checkpoint, and a checkpoint given with --resume may come from another run.
"""

from dataclasses import replace
from pathlib import Path

from lm.training.config import RunConfig
from lm.training.consolidate import checkpoint_format
from lm.training.data_only import load
from lm.training.schedule import lr_at
from lm.util.errors import UserError

OPTIM_FIELDS = ("lr", "schedule", "warmup_steps", "init_lr", "min_lr_ratio", "decay_fraction")  # what lr_at reads


def saved_hyperparameters(checkpoint: Path) -> dict:
    """The hyperparameters LMModule saved in a checkpoint of any strategy, read without its weights (memory-mapped):
    Lightning's client state in a plain file, in DeepSpeed's rank-0 model-states file, or in FSDP2's meta.pt."""
    kind = checkpoint_format(checkpoint)
    if kind == "plain":
        state = load(checkpoint, mmap=True)
    elif kind == "deepspeed":  # ZeRO-1/2: mp_rank_00_model_states.pt; ZeRO-3: one per rank, rank 0's holds it too
        names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
        files = [path for name in names if (path := checkpoint / "checkpoint" / name).is_file()]
        state = load(files[0], mmap=True) if files else {}
    else:
        state = load(checkpoint / "meta.pt")
    return state.get("hyper_parameters") or {}


def schedule_of(max_steps: int, optim: dict) -> dict:
    """The settings the learning rate depends on, by their config names."""
    return {"trainer.max_steps": max_steps, **{f"optim.{name}": optim.get(name) for name in OPTIM_FIELDS}}


def schedule_change(checkpoint: Path, step: int, config: RunConfig) -> dict[str, list]:
    """{config name: [the checkpoint's value, this run's]} of the schedule's settings that differ (empty: none). A
    change is refused (UserError) unless config.trainer.allow_schedule_change."""
    saved = saved_hyperparameters(checkpoint)
    if "optim" not in saved or "max_steps" not in saved:
        return {}  # nothing to compare with
    old = schedule_of(saved["max_steps"], saved["optim"])
    new = schedule_of(config.trainer.max_steps, vars(config.optim))
    change = {name: [old[name], new[name]] for name in old if old[name] != new[name]}
    if change and not config.trainer.allow_schedule_change:
        said = ", ".join(f"{name} {was} -> {now}" for name, (was, now) in change.items())
        trained = replace(config.optim, **{k: saved["optim"][k] for k in OPTIM_FIELDS if k in saved["optim"]})
        before = lr_at(step, saved["max_steps"], trained)
        after = lr_at(step, config.trainer.max_steps, config.optim)
        raise UserError(f"{checkpoint} was trained under another learning-rate schedule ({said}; the rate at step "
                        f"{step}: {before:.3g} there, {after:.3g} here): set them back to resume it, or pass "
                        "--trainer.allow_schedule_change true to continue on this schedule")
    return change

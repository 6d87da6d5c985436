"""Checkpoints that are complete or absent: written to a temporary file and renamed; found by step."""

import os
import re
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

STEP_FILE = re.compile(r"^step=(\d+)\.ckpt$")


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to `path.tmp`, fsync, then rename: a crash leaves the previous checkpoints intact."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class StepCheckpoint(ModelCheckpoint):
    """Keeps the newest `keep_last` checkpoints `step=NNNNNNNN.ckpt`, every `every` steps and at the end."""

    def __init__(self, dirpath: str, every: int, keep_last: int):
        super().__init__(dirpath=dirpath, filename="step={step:08d}", auto_insert_metric_name=False,
                         every_n_train_steps=every, save_top_k=keep_last, monitor="step", mode="max")

    def on_train_end(self, trainer, pl_module):
        if not self._should_skip_saving_checkpoint(trainer):  # the last step, unless `every` divided it
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))


def newest_checkpoint(directory: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `directory`, or None (temporary files are ignored)."""
    steps = [(int(m.group(1)), p) for p in Path(directory).glob("step=*.ckpt") if (m := STEP_FILE.match(p.name))]
    return max(steps)[1] if steps else None


def load_model(path: str | Path, map_location: str = "cpu"):
    """(LanguageModel in eval mode, hyperparameters) from a Lightning checkpoint written by `lm train`."""
    from lm.errors import UserError
    from lm.model import LanguageModel, LMConfig

    path = Path(path)
    if path.is_dir():  # a run directory: its newest checkpoint
        found = newest_checkpoint(path / "checkpoints") or newest_checkpoint(path)
        if found is None:
            raise UserError(f"no checkpoint in {path}")
        path = found
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:
        raise UserError(f"cannot read checkpoint {path}: {' '.join(str(err).split())[:200]}") from None
    hparams = checkpoint["hyper_parameters"]
    model = LanguageModel(LMConfig(**hparams["model"]))
    prefix = "model."
    model.load_state_dict({k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)})
    return model.eval(), hparams


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory holding a checkpoint (run_dir/checkpoints/step=N.ckpt) or the directory itself."""
    path = Path(checkpoint)
    if path.is_dir():
        return path
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent

"""Checkpoints are data, never code: a pickled payload put in any strategy's checkpoint (a plain file's
hyperparameters, a DeepSpeed shard, an FSDP2 directory's metadata, meta.pt or an item inside a .distcp file) is
refused by every command that reads one, in one line naming what it asks for, with exit status 2, before the payload
runs or anything is written."""

import dataclasses
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from strategy_runs import ONE_PROCESS, STRATEGIES

from lm.cli import main
from lm.training.checkpoint import CONTENTS, manifest_of, write_manifest
from lm.training.data_only import load, require_data_only
from lm.util.errors import UserError

STEP = "step=00000004.ckpt"


class Payload:
    """Runs a shell command when unpickled: it touches `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _retorch(file: Path, change) -> None:
    """Load a torch file of ours (trusted), change it, save it back."""
    data = torch.load(file, map_location="cpu", weights_only=False)
    change(data)
    torch.save(data, file)


def _plant_in_hparams(checkpoint: Path, payload: Payload) -> None:
    _retorch(checkpoint, lambda c: c["hyper_parameters"].update(note=payload))


def _plant_in_deepspeed_shard(checkpoint: Path, payload: Payload) -> None:
    _retorch(checkpoint / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             lambda c: c.update(note=payload))


def _plant_in_dcp_metadata(checkpoint: Path, payload: Payload) -> None:
    with open(checkpoint / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 (our own file)
    metadata.planner_data = payload
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _plant_in_meta_pt(checkpoint: Path, payload: Payload) -> None:
    _retorch(checkpoint / "meta.pt", lambda c: c["hyper_parameters"].update(note=payload))


def _plant_in_distcp_item(checkpoint: Path, payload: Payload) -> None:
    """A non-tensor item of the optimizer state (DCP writes each as torch.save'd bytes inside a .distcp file, where the
    metadata says): the payload's bytes appended to that file, and the item pointed at them."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(checkpoint / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 (our own file)
    fqn = next(fqn for fqn, entry in metadata.state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata))
    where = metadata.storage_data[MetadataIndex(fqn)]
    shard = checkpoint / where.relative_path
    original = torch.load(io.BytesIO(shard.read_bytes()[where.offset:where.offset + where.length]), weights_only=False)
    item = io.BytesIO()
    torch.save({"item": original, "note": payload}, item)
    with open(shard, "ab") as f:
        offset = f.tell()
        f.write(item.getvalue())
    metadata.storage_data[MetadataIndex(fqn)] = dataclasses.replace(where, offset=offset, length=len(item.getvalue()))
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


PLANTS = {"hparams": ("single", ONE_PROCESS, _plant_in_hparams),
          "deepspeed shard": ("zero2", STRATEGIES["zero2"], _plant_in_deepspeed_shard),
          "dcp metadata": ("fsdp2", STRATEGIES["fsdp2"], _plant_in_dcp_metadata),
          "fsdp2 meta.pt": ("fsdp2", STRATEGIES["fsdp2"], _plant_in_meta_pt),
          "dcp .distcp item": ("fsdp2", STRATEGIES["fsdp2"], _plant_in_distcp_item)}


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


@pytest.fixture(params=list(PLANTS))
def planted(request, strategy_runs, tmp_path):
    """A copy of a strategy's run whose newest checkpoint carries the payload, its manifest rewritten to match (so
    that only the payload can make a command refuse it)."""
    run_name, flags, plant = PLANTS[request.param]
    run = tmp_path / "run"
    shutil.copytree(strategy_runs[run_name], run)
    checkpoint, marker = run / "checkpoints" / STEP, tmp_path / "payload-ran"
    plant(checkpoint, Payload(marker))
    manifest = checkpoint / CONTENTS if checkpoint.is_dir() else manifest_of(checkpoint)
    manifest.unlink()
    write_manifest(checkpoint, manifest)
    return run, checkpoint, marker, flags, strategy_runs["config"]


def test_every_command_that_reads_a_checkpoint_refuses_a_payload(planted, tmp_path, capsys):
    run, checkpoint, marker, flags, config = planted
    out = tmp_path / "out"
    commands = {
        "generate": ["generate", "--checkpoint", str(checkpoint), "--prompt", "In the"],
        "eval ppl (a run directory)": ["eval", "ppl", "--checkpoint", str(run), "--out", str(out)],
        "eval harness": ["eval", "harness", "--checkpoint", str(checkpoint), "--tasks", "[kjv_cloze]",
                         "--out", str(out)],
        "eval longctx": ["eval", "longctx", "--checkpoint", str(checkpoint), "--probes", "[passkey]",
                         "--lengths", "[256]", "--depths", "[0.5]", "--out", str(out)],
        "export": ["export", "--checkpoint", str(checkpoint), "--out", str(out)],
        "export --format hf": ["export", "--checkpoint", str(checkpoint), "--out", str(out), "--format", "hf"],
        "train --resume PATH": ["train", "--config", str(config), "--run_dir", str(tmp_path / "other"),
                                "--resume", str(checkpoint), *flags],
        "train (resumes the newest)": ["train", "--config", str(config), "--run_dir", str(run), *flags],
    }
    before = _tree(run)
    for name, argv in commands.items():
        assert main(argv) == 2, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "asks for posix.system" in lines[0], (name, lines)
        assert not marker.exists(), name
        assert not out.exists() and not (tmp_path / "other").exists(), name
        assert _tree(run) == before, name  # nothing written, nothing moved


def test_whole_checkpoints_of_every_strategy_read_as_data(strategy_runs):
    """The names allowed for DeepSpeed and DCP are enough for what they write; nothing else is needed."""
    for name in ("single", "ddp", "zero2", "zero3", "fsdp2"):
        require_data_only(strategy_runs[name] / "checkpoints" / STEP)


def test_a_refusal_names_the_global_and_runs_nothing(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "x.pt"
    torch.save({"weights": torch.ones(2), "extra": Payload(marker)}, path)
    with pytest.raises(UserError, match=r"asks for posix\.system"):
        load(path)
    assert not marker.exists()
    torch.save({"weights": torch.ones(2), "extra": {"nested": [1, "two", 3.0]}}, path)
    assert load(path)["extra"] == {"nested": [1, "two", 3.0]}

"""Everything `lm train` checks before it builds the run, in the order it checks it, and without Lightning, DeepSpeed
or transformers: `lm train` (lm.cli.train) runs these before it imports them, so that a mistake ends in one line
(exit 2) within a second or two of start-up, with nothing written. lm.training.train builds the run on what they
found.

1. the config alone: the mixers' options, the batch (global batch, accumulation, the context-parallel layout), the
   launch (SLURM, torchrun, nodes) and the strategy on this machine (lm.training.launch_guard);
2. the data: every source's manifest and shards (their sha256 with data.verify), one tokenizer, a window to train on
   and, unless data.val_windows is 0, one to validate on;
3. the model against the data: the vocabulary, the length, the documents' separator, the sources' tokens;
4. the resume: the checkpoint whole and holding data only, a format this strategy can continue, and the learning-rate
   schedule it was trained under (lm.training.schedule_change);
5. notices, one line each: a validation split smaller than `lm prepare`'s floor.
"""

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from lm.data_prep.holdout import Holdout
from lm.mixers.context_parallel import check_layout
from lm.training.batch import global_batch_of, resolve_accumulation
from lm.training.checkpoint import newest_checkpoint, require_usable
from lm.training.config import RunConfig
from lm.training.consolidate import checkpoint_format, checkpoint_world_size, deepspeed_stage
from lm.training.data import TokenStream, check_one_tokenizer, check_validation, count_windows
from lm.training.data_only import require_data_only
from lm.training.launch_guard import check_launch
from lm.training.run_record import resumed_step
from lm.training.schedule_change import schedule_change
from lm.training.stop_request import is_rank_zero
from lm.util.errors import UserError


@dataclass
class Checked:
    """What the checks found, which building the run takes: the config (with the data's document separator where
    data.reset_at_documents asks for it), the first source's manifest, the batch, the checkpoint to resume (None: a
    fresh start) and whether only its weights can be carried, and the schedule's change that was allowed."""

    config: RunConfig
    manifest: dict
    replicas: int
    accumulate: int
    global_batch: int
    checkpoint: Path | None = None
    weights_only: bool = False
    schedule_change: dict = dataclasses.field(default_factory=dict)


def preflight(config: RunConfig, resume: str = "auto") -> Checked:
    """Every check of a launch, in order (this module's docstring); bad input raises UserError."""
    replicas, accumulate, global_batch = batch_plan(config)
    check_launch(config)  # the mixers' options, the launch, the strategy here; says a silent precision change
    manifest, validation = check_data(config)
    check_compatible(config, manifest)
    config = with_document_resets(config, manifest)
    check_source_tokens(config, global_batch)
    checkpoint = resolve_resume(Path(config.run_dir), resume)
    checked = Checked(config, manifest, replicas, accumulate, global_batch, checkpoint)
    if checkpoint is not None:
        checked.weights_only = needs_weights_only(checkpoint, config)
        checked.schedule_change = schedule_change(checkpoint, resumed_step(checkpoint), config)
    if is_rank_zero():
        for line in notices(checked, validation):
            print(f"lm train: {line}", file=sys.stderr)
    return checked


def batch_plan(config: RunConfig) -> tuple[int, int, int]:
    """(data-parallel size, accumulation, global batch in sequences) from the config (lm.training.batch). The ranks
    of a context group share their windows, so the data-parallel size is the world over strategy.context_parallel."""
    d, pieces = config.data, config.strategy.context_parallel
    check_layout(pieces, d.seq_len)
    if pieces > 1 and config.eval.every:
        raise UserError("eval.every evaluates on each rank alone, which strategy.context_parallel's ranks cannot: "
                        "evaluate the run's checkpoints with lm eval instead")
    replicas = config.strategy.data_parallel_size
    global_batch = global_batch_of(d.global_batch, d.global_batch_tokens, d.seq_len)
    accumulate = resolve_accumulation(global_batch, d.micro_batch, config.trainer.accumulate, replicas)
    return replicas, accumulate, d.micro_batch * accumulate * replicas


def check_data(config: RunConfig) -> tuple[dict, dict[str, int]]:
    """The data as the run's data module (lm.training.data_module) opens it: (the first source's manifest, the
    windows each source's validation split holds; none when data.val_windows is 0)."""
    d = config.data
    sources = d.mixture()
    train = [TokenStream(s.path, "train", verify=d.verify) for s in sources]
    check_one_tokenizer(sources, [stream.manifest for stream in train])
    validation = {s.path: TokenStream(s.path, "validation", verify=False) for s in sources}  # verified with train
    for stream in train:
        if count_windows(stream.total, d.seq_len) == 0:
            raise UserError(f"{stream.directory}: {stream.total} training tokens is less than one window of "
                            f"seq_len + 1 = {d.seq_len + 1}")
    if d.val_windows == 0:
        return train[0].manifest, {}
    for stream in validation.values():
        check_validation(stream, d.seq_len)
    return train[0].manifest, {path: count_windows(s.total, d.seq_len) for path, s in validation.items()}


def check_compatible(config: RunConfig, manifest: dict) -> None:
    """The model must cover the tokenizer's vocabulary and the training length."""
    vocab = manifest["tokenizer"]["vocab_size"]
    if config.model.vocab_size < vocab:
        raise UserError(f"vocab mismatch: the tokenizer of {config.data.first_path} has {vocab} tokens but "
                        f"model.vocab_size is {config.model.vocab_size}")
    if config.data.seq_len > config.model.max_seq_len:
        raise UserError(f"data.seq_len {config.data.seq_len} is larger than model.max_seq_len "
                        f"{config.model.max_seq_len}")


def with_document_resets(config: RunConfig, manifest: dict) -> RunConfig:
    """data.reset_at_documents: the model resets at the data's separator (model.document_separator), which the
    checkpoint then carries to evaluation and generation. A separator set by hand must be the data's."""
    separator, given = manifest["tokenizer"].get("sep_id"), config.model.document_separator
    if config.data.reset_at_documents and separator is None:
        raise UserError(f"data.reset_at_documents: {config.data.first_path}/manifest.json names no separator id "
                        "(prepare it again with lm prepare)")
    if given is not None and given != separator:
        raise UserError(f"model.document_separator {given} is not the separator {separator} of "
                        f"{config.data.first_path}")
    if given is not None and not config.data.reset_at_documents:
        raise UserError("model.document_separator is set by data.reset_at_documents: set that instead")
    if config.data.reset_at_documents:
        config.model = dataclasses.replace(config.model, document_separator=separator)
    return config


def check_source_tokens(config: RunConfig, global_batch: int) -> None:
    """Sources given in tokens must add up to the run's tokens (within one step's: the schedule rounds)."""
    sources, step = config.data.sources, global_batch * config.data.seq_len
    if sources and sources[0].tokens is not None:
        given, run = sum(s.tokens for s in sources), config.trainer.max_steps * step
        if abs(given - run) > step:
            raise UserError(f"data.sources ask for {given:,} tokens, but the run trains {run:,} (trainer.max_steps "
                            f"{config.trainer.max_steps} x {step:,} tokens per step): make them agree, or give weights")


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to continue from: 'auto' (newest usable one if any), 'last' (the same, required) or a path."""
    if resume in ("auto", "last"):
        newest = newest_checkpoint(run_dir / "checkpoints")
        if newest is None and resume == "last":
            raise UserError(f"--resume last: no checkpoint in {run_dir / 'checkpoints'} (or none usable)")
    elif not Path(resume).exists():
        raise UserError(f"--resume: checkpoint {resume} not found")
    else:
        newest = require_usable(resume)
    if newest is not None:
        require_data_only(newest)
    return newest


def target_format(config: RunConfig) -> str:
    return {"deepspeed": "deepspeed", "fsdp": "dcp"}.get(config.strategy.name, "plain")


def needs_weights_only(checkpoint: Path, config: RunConfig) -> bool:
    """Whether this run's strategy continues the checkpoint natively (False), or only its weights, with a fresh
    optimizer state (True, said in a warning; lm.training.train writes that copy). Native where the formats allow (a
    plain file into single or DDP, FSDP2 shards at any world size, DeepSpeed shards at the same stage and world
    size); FSDP2 and DeepSpeed take only their own shards: into FSDP2, torch's set_optimizer_state_dict fails on a
    plain file's optimizer state, fresh or not (tests/test_scale_out.py). An impossible one is a UserError."""
    source, target, world = checkpoint_format(checkpoint), target_format(config), config.strategy.world_size
    if source == target == "plain" or source == target == "dcp":
        return False
    if source == target == "deepspeed":
        if (checkpoint_world_size(checkpoint), deepspeed_stage(checkpoint)) == (world, config.strategy.zero_stage):
            return False
    if target == "deepspeed":
        raise UserError(f"cannot resume DeepSpeed ZeRO-{config.strategy.zero_stage} on {world} processes from "
                        f"{checkpoint} ({source} format, {checkpoint_world_size(checkpoint) or 1} processes): use "
                        f"the strategy and world size that wrote it, or single / ddp, which can take its weights")
    if target == "dcp":
        raise UserError(f"cannot resume FSDP2 from {checkpoint} ({source} format): FSDP2 continues only its own "
                        "shards; use the strategy that wrote it, or single / ddp, which can take its weights")
    print(f"lm train: warning: {checkpoint} ({source} format) cannot carry its optimizer state into "
          f"{config.strategy.name} on {world} processes; resuming with its weights and a fresh optimizer state",
          file=sys.stderr)
    return True


def notices(checked: Checked, validation: dict[str, int]) -> list[str]:
    """What the run should know before it starts, one line each."""
    lines = []
    floor, seq_len = Holdout.min_windows, checked.config.data.seq_len
    if small := {path: n for path, n in validation.items() if n < floor}:
        held = ", ".join(f"{n} in {path}" for path, n in small.items())
        lines.append(f"warning: validation holds fewer than {floor} windows of data.seq_len {seq_len} ({held}): its "
                     "loss will be noisy; prepare the data with a larger hold-out (lm prepare --val_fraction), or set "
                     "data.val_windows 0 to train without validation")
    if change := checked.schedule_change:
        said = ", ".join(f"{name} {was} -> {now}" for name, (was, now) in change.items())
        lines.append(f"continuing {checked.checkpoint} on a changed learning-rate schedule ({said}), as "
                     "trainer.allow_schedule_change says; the run's record notes it")
    return lines

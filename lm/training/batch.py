"""Batch arithmetic: global batch = micro-batch x accumulation x world size, in sequences (and seq_len x that
in tokens). The config names the global batch; accumulation follows from the world size, or is given and checked."""

from lm.util.errors import UserError


def global_batch_of(global_batch: int | None, global_batch_tokens: int | None, seq_len: int) -> int | None:
    """The global batch in sequences from either form (both given: they must agree)."""
    if global_batch_tokens is not None:
        if global_batch_tokens % seq_len:
            raise UserError(f"data.global_batch_tokens {global_batch_tokens} is not a multiple of data.seq_len "
                            f"{seq_len}")
        if global_batch is not None and global_batch * seq_len != global_batch_tokens:
            raise UserError(f"data.global_batch {global_batch} sequences x seq_len {seq_len} is not "
                            f"data.global_batch_tokens {global_batch_tokens}")
        return global_batch_tokens // seq_len
    return global_batch


def resolve_accumulation(global_batch: int | None, micro_batch: int, accumulate: int | None, world: int) -> int:
    """Micro-batches per optimizer step on each rank."""
    if global_batch is None:
        return accumulate or 1
    per_step = micro_batch * world
    if global_batch % per_step:
        raise UserError(f"global batch {global_batch} sequences is not a multiple of micro_batch {micro_batch} x "
                        f"world size {world} = {per_step}")
    derived = global_batch // per_step
    if accumulate is not None and accumulate != derived:
        raise UserError(f"trainer.accumulate {accumulate} does not give the global batch {global_batch}: with "
                        f"micro_batch {micro_batch} and world size {world} it must be {derived}")
    return derived

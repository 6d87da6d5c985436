"""Context parallelism: each window split into N contiguous pieces over the ranks of a context group.

Rank i of the group holds tokens [i T/N, (i + 1) T/N) of every window. This module forms the groups and gives each
rank its piece; how each layer's mixer on rank i gets what the same layer did with the pieces before it (the
recurrences' exchange of transfer maps, attention's gathered keys and values, and their backward across the ranks) is
in lm/mixers/context.py, which every mixer's `mix_in_context` uses.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lm.errors import UserError


@dataclass(frozen=True)
class ContextGroup:
    """The ranks that share each window, in the order of their pieces, and this rank's place among them."""

    group: object  # the torch.distributed ProcessGroup of these ranks
    ranks: tuple[int, ...]  # global ranks, piece 0 first
    index: int  # this rank's piece

    @property
    def size(self) -> int:
        return len(self.ranks)

    def piece(self, tokens: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous piece of `tokens` along `dim` (the time axis), whose length N must divide."""
        length = tokens.shape[dim]
        if length % self.size:
            raise UserError(f"a sequence of {length} tokens does not split into {self.size} equal pieces "
                            f"(strategy.context_parallel {self.size} must divide data.seq_len)")
        step = length // self.size
        return tokens.narrow(dim, self.index * step, step)


def context_groups(world: int, size: int) -> list[tuple[int, ...]]:
    """The context groups of a world: consecutive ranks (on one node where a node's GPUs are a multiple of `size`, so
    the state passes over the fastest links); rank r has piece r mod size of data-parallel rank r // size."""
    return [tuple(range(start, start + size)) for start in range(0, world, size)]


def join_context_group(size: int) -> ContextGroup | None:
    """This process's ContextGroup in the initialised default process group, or None for size 1. Every rank creates
    every group (torch.distributed.new_group's rule), in the same order."""
    if size == 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % size:
        raise UserError(f"strategy.context_parallel {size} does not divide the {world} processes")
    mine = None
    for ranks in context_groups(world, size):
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = ContextGroup(group, ranks, ranks.index(rank))
    return mine

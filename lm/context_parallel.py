"""Context parallelism: each window split into N contiguous pieces over the ranks of a context group.

Rank i of the group holds tokens [i T/N, (i + 1) T/N) of every window. Each layer's mixer on rank i must see what the
same layer did with the pieces before it on ranks 0..i - 1: by the mixer contract (DESIGN.md: a sequence split
anywhere and fed in order with its state carried gives what one call gives), the state that layer ends piece i - 1
with. The ranks compute it together rather than passing it from rank to rank, so that none waits for another's layer
to finish:

- a recurrent mixer exchanges transfer maps (`mix_in_parallel`): every piece runs from the zero state at once, the
  group gathers each piece's (transfer map, final state from zero), and each rank composes its true entering state
  from those of the pieces before it (lm/ops/state_transfer.py) and runs its piece from there;
- attention and SWA gather the keys and values of the group (`attend_in_parallel`; SWA keeps the last window - 1).

The gathers are autograd Functions whose backward sums each tensor's gradients over the ranks, so every parameter's
gradient is the whole window's. They happen inside each block, after FSDP2 has gathered its weights, in the same order
on every rank.
"""


from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

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


class _GatherPieces(torch.autograd.Function):
    """Forward: every rank's copy of each tensor (all_gather), with x passed on to tie this into the graph on every
    rank, so that each rank's backward reaches it in the same order. Backward: each tensor's gradient is the sum
    over the ranks of the gradients of their copies of it (an all_reduce; gloo has no reduce_scatter)."""

    @staticmethod
    def forward(ctx, x, group: ContextGroup, *tensors):
        gathered = []
        for tensor in tensors:
            copies = [torch.empty_like(tensor) for _ in range(group.size)]
            dist.all_gather(copies, tensor.detach().contiguous(), group=group.group)
            gathered += copies
        ctx.group, ctx.floating = group, [tensor.is_floating_point() for tensor in tensors]
        ctx.mark_non_differentiable(*(t for t in gathered if not t.is_floating_point()))
        return x.view_as(x), *gathered

    @staticmethod
    def backward(ctx, grad_x, *grads):
        size, index = ctx.group.size, ctx.group.index
        mine = []
        for i, floating in enumerate(ctx.floating):
            if not floating:  # an integer or bool tensor (document starts) has no gradient
                mine.append(None)
                continue
            total = torch.stack(grads[i * size:(i + 1) * size])
            dist.all_reduce(total, group=ctx.group.group)
            mine.append(total[index])
        return grad_x, None, *mine


def gather_pieces(x: torch.Tensor, tree, group: ContextGroup) -> tuple[torch.Tensor, list]:
    """(x, [tree as rank j of the group holds it, for every j]): the tensors of a pytree gathered over the group,
    differentiably (what is not a tensor is taken as it is). Every rank passes a tree of the same structure and
    shapes."""
    leaves, spec = tree_flatten(tree)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    x, *copies = _GatherPieces.apply(x, group, *tensors)
    trees = []
    for j in range(group.size):
        mine = iter(copies[i * group.size + j] for i in range(len(tensors)))
        trees.append(tree_unflatten([next(mine) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
                                    spec))
    return x, trees


def mix_in_parallel(mixer, x: torch.Tensor, reset: torch.Tensor | None, group: ContextGroup) -> torch.Tensor:
    """A recurrent mixer's output on this rank's piece x, entered with the state of the whole window before it,
    through an exchange of transfer maps (the module docstring).

    1. The convs' tails: from a run over the piece's last few tokens, gathered, the previous piece's taken.
    2. From those, the carried entry this piece ends with from zero, and its transfer map (`mixer.piece_transfer`;
       recomputed in the backward, so that it keeps only its inputs).
    3. Gathered over the group; the entering state composed from the pieces before this one (`mixer.carry`).
    4. The piece run from its true entering state."""
    tails = {}
    length = mixer.conv_tail_length()
    if length:
        if x.shape[1] < length:
            raise UserError(f"a context-parallel piece of {x.shape[1]} tokens is shorter than the {length} inputs a "
                            f"convolution carries; use a smaller strategy.context_parallel or longer windows")
        _, own = mixer(x[:, -length:], None, None if reset is None else reset[:, -length:])
        x, every = gather_pieces(x, {k: v for k, v in own.items() if k != mixer.carried}, group)
        tails = every[group.index - 1] if group.index else {}
    # Recomputed in the backward rather than kept: what it would keep is as large as the piece's own run.
    final, transfer = checkpoint(mixer.piece_transfer, x, tails, reset, use_reentrant=False)
    x, every = gather_pieces(x, (final, transfer), group)
    entering = None
    for before_final, before_transfer in every[:group.index]:
        entering = mixer.carry(entering, before_transfer, before_final)
    y, _ = mixer(x, {**tails, mixer.carried: entering}, reset)
    return y


def attend_in_parallel(attention, x: torch.Tensor, reset: torch.Tensor | None, group: ContextGroup) -> torch.Tensor:
    """Attention's (or SWA's) output on this rank's piece x after the pieces before it: its queries, keys and values
    at their positions in the window (RoPE counts from rank i's first token, i x the piece; with documents, from the
    start of the document the piece begins in, found from the gathered resets), then the keys and values of the
    earlier pieces gathered from their ranks (SWA keeps the last window - 1)."""
    B, length, _ = x.shape
    seen, start = group.index * length, None
    if reset is not None:  # the document a piece begins in starts at the last reset before it (or at 0)
        x, every = gather_pieces(x, reset.to(torch.uint8), group)  # (gloo gathers no bool)
        before = torch.cat(every[:group.index] or [reset[:, :0]], dim=1).bool()
        positions = torch.arange(before.shape[1], device=x.device)
        start = torch.where(before, positions, 0).amax(1) if before.shape[1] else reset.new_zeros(B, dtype=torch.long)
    q, k, v, _, starts, start_after = attention.project(x, (None, None, seen, start), reset)
    q, every = gather_pieces(q, (k, v), group)  # tied to q, which every rank's output needs
    keys, values = (torch.cat([pair[i] for pair in every[:group.index]] or [t[:, :, :0]], dim=2)
                    for i, t in ((0, k), (1, v)))
    if attention.window is not None:
        keys, values = attention.last_window(keys), attention.last_window(values)
    y, _ = attention.attend(q, k, v, seen, starts, start_after, (keys, values, seen, start))
    return y

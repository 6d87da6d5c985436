"""Context parallelism (`strategy.context_parallel N`): each window split into N contiguous pieces over the ranks of a
context group, and how each layer on rank i sees what the same layer did with the pieces before its own.

The layout: consecutive ranks form a group (on one node where a node's GPUs are a multiple of N, so the state passes
over the fastest links), so rank r holds piece r mod N of the windows of data-parallel replica r // N (`layout`, the
one place that says so; the data stream reads it). `check_layout` is the one check that N divides the window and the
processes, which the strategy, the plans and `lm train` call.

By the mixer contract (docs/design.md: a sequence split anywhere and fed in order with its state carried gives what one
call gives), rank i's piece gives the whole window's result if it starts from the state the layer ends piece i - 1
with. The ranks compute those states together, so that none waits for another's layer to finish:

- a recurrent mixer's op call (its `op_inputs`, lm.ops.call) runs on every piece from the zero state at once; the
  group gathers each piece's (transfer map, final state from zero), found by the op's name in lm.ops.state_transfer;
  each rank composes its true entering state from those of the pieces before it and runs its piece from there
  (`mix_in_parallel`): no mixer writes anything for this;
- attention and SWA gather the keys and values of the group (their own `mix_in_context`, with `gather_pieces`).

The gathers are autograd Functions whose backward sums each tensor's gradients over the ranks, so every parameter's
gradient is the whole window's. They happen inside each block, after FSDP2 has gathered its weights, in the same order
on every rank.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from lm.ops.state_transfer import TRANSFERS, carry, carry_first, first_transfer, piece_transfer
from lm.util.errors import UserError


def check_layout(pieces: int, seq_len: int | None = None, processes: int | None = None,
                 what: str = "strategy.context_parallel", window: str = "data.seq_len") -> None:
    """N = pieces must divide the window (seq_len) and the processes, each where given; one line otherwise. `what`
    names where N came from and `window` where the window's length did, for the message."""
    if not (isinstance(pieces, int) and not isinstance(pieces, bool) and pieces >= 1):
        raise UserError(f"{what} must be a number of at least 1, got {pieces!r}")
    if seq_len is not None and seq_len % pieces:
        raise UserError(f"{what} {pieces} does not divide {window} {seq_len} into equal pieces")
    if processes is not None and processes % pieces:
        raise UserError(f"{what} {pieces} does not divide the {processes} processes")


def layout(rank: int, world: int, pieces: int) -> tuple[int, int, int]:
    """(data-parallel replica, replicas, piece) of global rank `rank` of `world` processes, N = pieces per window."""
    return rank // pieces, max(1, world // pieces), rank % pieces


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
        """This rank's contiguous piece of `tokens` along `dim` (the time axis)."""
        check_layout(self.size, seq_len=tokens.shape[dim])
        step = tokens.shape[dim] // self.size
        return tokens.narrow(dim, self.index * step, step)


def join_context_group(pieces: int) -> ContextGroup | None:
    """This process's ContextGroup in the initialised default process group, or None for N = 1. Every rank creates
    every group (torch.distributed.new_group's rule), in the same order."""
    if pieces == 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    check_layout(pieces, processes=world)
    mine = None
    for first in range(0, world, pieces):
        ranks = tuple(range(first, first + pieces))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = ContextGroup(group, ranks, layout(rank, world, pieces)[2])
    return mine


class _GatherPieces(torch.autograd.Function):
    """Forward: every rank's copy of each tensor (all_gather), with x passed on to tie this into the graph on every
    rank, so that each rank's backward reaches it in the same order. Backward: each tensor's gradient is the sum
    over the ranks of the gradients of their copies of it (an all_reduce; gloo has no reduce_scatter)."""

    @staticmethod
    def forward(ctx, x, group, *tensors):
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


def mix_in_context(mixer, x: torch.Tensor, reset: torch.Tensor | None, group: ContextGroup) -> torch.Tensor:
    """The mixer's output on this rank's piece x of each window, whose earlier pieces the group's earlier ranks hold:
    its own `mix_in_context` where it has one (attention), else the exchange of its op's transfer maps."""
    own = getattr(mixer, "mix_in_context", None)
    return own(x, reset, group) if own is not None else mix_in_parallel(mixer, x, reset, group)


def _first_transfer(mixer, x: torch.Tensor, tails: dict, reset: torch.Tensor | None) -> tuple:
    return first_transfer(mixer.op_inputs(x, tails, reset), reset)


def _piece_transfer(mixer, x: torch.Tensor, tails: dict, reset: torch.Tensor | None, entering_first) -> tuple:
    return piece_transfer(mixer.op_inputs(x, tails, reset), reset, entering_first)


# Eager under torch.compile (trainer.compile): the exchange branches on the rank's place in its group, so each rank
# would trace another graph, and the compiled graphs' collectives did not meet (gloo: "collective mismatch").
@torch._disable_dynamo  # torch.compiler.disable, dynamo imported at the first call, not here (lm.ops.self_check)
def mix_in_parallel(mixer, x: torch.Tensor, reset: torch.Tensor | None, group: ContextGroup) -> torch.Tensor:
    """A recurrent mixer's output on this rank's piece x, entered with the state of the whole window before it,
    through an exchange of transfer maps (the module docstring).

    1. The convs' tails: the op call's other state entries over the piece's last few inputs, gathered, the previous
       piece's taken.
    2. From those, the op's state this piece ends with from zero, and its transfer map (recomputed in the backward,
       so that it keeps only its inputs). An op whose map depends on a part of its state that evolves alone (the
       preconditioner of precond_delta_rule) exchanges and composes that part first, and the map starts from it.
    3. Gathered over the group; the entering state composed from the pieces before this one.
    4. The piece run from its true entering state."""
    tails = {}
    length = mixer.conv_tail_length()
    if length:
        if x.shape[1] < length:
            raise UserError(f"a context-parallel piece of {x.shape[1]} tokens is shorter than the {length} inputs a "
                            f"convolution carries; use a smaller strategy.context_parallel or longer windows")
        own = mixer.op_inputs(x[:, -length:], {}, None if reset is None else reset[:, -length:]).state
        x, every = gather_pieces(x, own, group)
        tails = every[group.index - 1] if group.index else {}
    op, entering_first = mixer.op_name(), None
    if TRANSFERS[op].first is not None:
        first = checkpoint(_first_transfer, mixer, x, tails, reset, use_reentrant=False)
        x, every = gather_pieces(x, first, group)
        for before_final, before_transfer in every[:group.index]:
            entering_first = carry_first(op, entering_first, before_transfer, before_final)
    # Recomputed in the backward rather than kept: what it would keep is as large as the piece's own run.
    final, transfer = checkpoint(_piece_transfer, mixer, x, tails, reset, entering_first, use_reentrant=False)
    x, every = gather_pieces(x, (final, transfer), group)
    entering = None
    for before_final, before_transfer in every[:group.index]:
        entering = carry(op, entering, before_transfer, before_final)
    y, _ = mixer(x, {**tails, "memory": entering}, reset)
    return y

"""Context parallelism: each window split into N contiguous pieces over the ranks of a context group.

Rank i of the group holds tokens [i T/N, (i + 1) T/N) of every window. Each layer's mixer on rank i starts from the
state that the same layer ends with on rank i - 1 (attention's KV cache, SWA's last window, the convolutions' tails, the
recurrent state: whatever the mixer returns as its state), sent from rank to rank. By the mixer contract (DESIGN.md: a
sequence split anywhere and fed in order with its state carried gives what one call gives) the group computes what one
process computes on the whole window, and the backward sends each state's gradient back the same way, so the
gradients are those of the whole window too.

The state passes in sequence: rank i runs layer l once rank i - 1 has, so the ranks run as a wavefront over the
layers, n_layers + N - 1 layer-pieces long rather than N x n_layers on one process. Activations per rank are those
of T/N tokens (attention also holds the keys and values before its piece).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

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


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor sits in a state being sent: what the receiver needs to allocate it, and whether its gradient
    comes back."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    differentiable: bool


def _slots(state) -> tuple[list, list, object]:
    """(tensors, their slots, the state's skeleton: its structure with each tensor replaced by its slot)."""
    leaves, spec = tree_flatten(state)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    slots = [_TensorSlot(tuple(t.shape), t.dtype, t.is_floating_point() and t.requires_grad) for t in tensors]
    it = iter(slots)
    skeleton = tree_unflatten([next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)
    return tensors, slots, skeleton


class _SendState(torch.autograd.Function):
    """Forward: send the state's tensors to the next rank, pass x on. Backward: receive their gradients from it."""

    @staticmethod
    def forward(ctx, x, group: ContextGroup, slots, *tensors):
        destination = group.ranks[group.index + 1]
        for tensor in tensors:
            dist.send(tensor.detach().contiguous(), destination, group=group.group)
        ctx.group, ctx.slots = group, slots
        return x.clone()

    @staticmethod
    def backward(ctx, grad_x):
        source = ctx.group.ranks[ctx.group.index + 1]
        grads = []
        for slot in ctx.slots:
            grad = None
            if slot.differentiable:
                grad = torch.empty(slot.shape, dtype=slot.dtype, device=grad_x.device)
                dist.recv(grad, source, group=ctx.group.group)
            grads.append(grad)
        return grad_x, None, None, *grads


class _ReceiveState(torch.autograd.Function):
    """Forward: receive the state's tensors from the previous rank (x passes on, to tie this into the graph).
    Backward: send their gradients back to it."""

    @staticmethod
    def forward(ctx, x, group: ContextGroup, slots):
        source = group.ranks[group.index - 1]
        tensors = []
        for slot in slots:
            tensor = torch.empty(slot.shape, dtype=slot.dtype, device=x.device)
            dist.recv(tensor, source, group=group.group)
            tensors.append(tensor)
        ctx.group, ctx.slots = group, slots
        ctx.mark_non_differentiable(*(t for t, slot in zip(tensors, slots) if not slot.differentiable))
        return x.clone(), *tensors

    @staticmethod
    def backward(ctx, grad_x, *grads):
        destination = ctx.group.ranks[ctx.group.index - 1]
        for grad, slot in zip(grads, ctx.slots):
            if slot.differentiable:
                grad = torch.zeros(slot.shape, dtype=slot.dtype, device=grad_x.device) if grad is None else grad
                dist.send(grad.contiguous(), destination, group=ctx.group.group)
        return grad_x, None, None


def send_state(x: torch.Tensor, state, group: ContextGroup) -> torch.Tensor:
    """Send a layer's final state to the next rank of the group (the last rank sends nothing); returns x, through
    which the state's gradient comes back in the backward."""
    if group.index == group.size - 1:
        return x
    tensors, slots, skeleton = _slots(state)
    dist.send_object_list([skeleton], group.ranks[group.index + 1], group=group.group)
    return _SendState.apply(x, group, slots, *tensors)


def receive_state(x: torch.Tensor, group: ContextGroup) -> tuple[torch.Tensor, object]:
    """(x, the state the same layer ended with on the previous rank), or (x, None) on the group's first rank."""
    if group.index == 0:
        return x, None
    message = [None]
    dist.recv_object_list(message, group.ranks[group.index - 1], group=group.group)
    skeleton = message[0]
    leaves, spec = tree_flatten(skeleton)
    slots = [leaf for leaf in leaves if isinstance(leaf, _TensorSlot)]
    x, *tensors = _ReceiveState.apply(x, group, slots)
    it = iter(tensors)
    return x, tree_unflatten([next(it) if isinstance(leaf, _TensorSlot) else leaf for leaf in leaves], spec)

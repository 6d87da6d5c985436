"""How a mixer's layer on rank i of a context group sees what the same layer did with the pieces of the window before
its own (context parallelism: lm.context_parallel forms the groups; a group is anything with `group`, the
torch.distributed ProcessGroup, `size` and `index`, this rank's piece).

By the mixer contract (DESIGN.md: a sequence split anywhere and fed in order with its state carried gives what one
call gives), rank i's piece gives the whole window's result if it starts from the state the layer ends piece i - 1
with. The ranks compute those states together, so that none waits for another's layer to finish:

- a recurrent mixer exchanges transfer maps (`mix_in_parallel`): every piece runs from the zero state at once, the
  group gathers each piece's (transfer map, final state from zero), and each rank composes its true entering state
  from those of the pieces before it (lm/ops/state_transfer.py) and runs its piece from there;
- attention and SWA gather the keys and values of the group (lm.mixers.attention's `mix_in_context`).

The gathers are autograd Functions whose backward sums each tensor's gradients over the ranks, so every parameter's
gradient is the whole window's. They happen inside each block, after FSDP2 has gathered its weights, in the same order
on every rank.
"""

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from lm.errors import UserError


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


def gather_pieces(x: torch.Tensor, tree, group) -> tuple[torch.Tensor, list]:
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


# Eager under torch.compile (trainer.compile): the exchange branches on the rank's place in its group, so each rank
# would trace another graph, and the compiled graphs' collectives did not meet (gloo: "collective mismatch").
@torch.compiler.disable
def mix_in_parallel(mixer, x: torch.Tensor, reset: torch.Tensor | None, group) -> torch.Tensor:
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

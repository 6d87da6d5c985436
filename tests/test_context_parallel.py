"""Context parallelism (lm.mixers.context_parallel): by 2 and 4 gloo processes (in one group of 4: two context groups
of 2 side by side, then one of 4), in float64, every registered mixer and a hybrid give what one process gives on the
whole window, to 1e-10: logits, loss, and the gradients of every parameter and of the embedded input, with documents
that start on a piece's boundary and inside a piece."""

import dataclasses
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from strategy_runs import free_port
from torch.utils.checkpoint import checkpoint

from lm.mixers import MIXERS
from lm.mixers.context_parallel import join_context_group, layout
from lm.mixers.protocol import _planned_call
from lm.model import LanguageModel, LMConfig

T, SEPARATOR = 24, 1  # pieces of 12 (2 ranks) and 6 (4 ranks)
# Both checked in one group of 4 processes: a process's start (torch and lm imported, each block compiled) costs
# more than the checks themselves.
SIZES = (2, 4)
# Small chunks and windows, so that a piece spans several chunks and the state that crosses ranks is all of it: every
# mixer with a chunk_size gets SMALL's, and these their own besides.
SMALL = {"chunk_size": 4, "sub_chunk": 4}
OPTIONS = {"attention": {"n_kv_heads": 1}, "swa": {"window": 5}, "gla": {"chunk_size": 8, "conv_size": 4},
           "mlstm": {"conv_size": 4}}
# The last two with activation checkpointing, and with each block compiled (trainer.compile) by AOTAutograd without
# Inductor's code generation, which would cost minutes here: with the exchange traced, the ranks' collectives did
# not meet, and they waited for ever (the fixture's deadline).
MODELS = [*sorted(MIXERS), "hawk,mesa", "mesa,swa", "mesa,swa recomputed", "hawk,swa compiled"]


def options(name: str) -> dict:
    fields = {f.name for f in dataclasses.fields(MIXERS[name].Options)}
    return {**{key: value for key, value in SMALL.items() if key in fields}, **OPTIONS.get(name, {})}


def build(model: str) -> LanguageModel:
    torch.manual_seed(0)
    name, _, variant = model.partition(" ")
    pattern = name if "," in name else None
    names = name.split(",")
    cfg = LMConfig(vocab_size=40, d_model=16, n_layers=2 * len(names), n_heads=2, head_dim=8, mixer=names[0],
                   layer_pattern=pattern, mixer_options={n: options(n) for n in names}, max_seq_len=T,
                   document_separator=SEPARATOR)
    model = LanguageModel(cfg).double()
    model.activation_checkpointing = variant == "recomputed"  # each block run again in the backward, exchange included
    if variant == "compiled":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    return model


def windows() -> torch.Tensor:
    """Two rows of T + 1 tokens; documents start at 12 (a piece boundary at 2 and 4 ranks), 6 (one at 4 ranks, inside a
    piece at 2) and 9 (inside a piece at both)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 40, (2, T + 1), generator=generator)
    tokens[0, 12] = tokens[0, 9] = tokens[1, 6] = SEPARATOR
    return tokens


def run(model: LanguageModel, tokens: torch.Tensor) -> dict:
    """Loss, logits, parameter gradients and the gradient of the embedded input of one forward and backward."""
    embedded = []

    def keep(module, args, out):
        out.retain_grad()
        embedded.append(out)

    hook = model.embed.register_forward_hook(keep)
    model.zero_grad()
    loss, _ = model(tokens[:, :-1], targets=tokens[:, 1:])
    hook.remove()
    loss.backward()
    with torch.no_grad():
        logits, _ = model(tokens[:, :-1])
    return {"loss": loss.detach(), "logits": logits, "input_grad": embedded[0].grad,
            "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


def compare(name: str, group, whole: dict | None) -> dict | None:
    """On every rank of `group`: `name` run by pieces over the group. On its first rank, which holds `whole` (one
    process's run of the whole window), the worst difference of each result from it."""
    model = build(name)
    model.context = group
    tokens = windows()
    piece = torch.cat([group.piece(tokens[:, :-1]), group.piece(tokens[:, 1:])[:, -1:]], dim=1)
    mine = run(model, piece)
    # The loss of the window is the mean of the pieces'; its gradients are the sum over ranks of each rank's
    # gradients of its own piece's loss, over the number of pieces.
    first, size = group.ranks[0], group.size
    loss = mine["loss"].clone()
    dist.reduce(loss, first, group=group.group)
    logits, input_grad = ([torch.empty_like(mine[key]) for _ in range(size)] for key in ("logits", "input_grad"))
    dist.all_gather(logits, mine["logits"], group=group.group)
    dist.all_gather(input_grad, mine["input_grad"], group=group.group)
    for grad in mine["grads"].values():
        dist.reduce(grad, first, group=group.group)
    if whole is None:
        return None
    worst = {"loss": float((loss / size - whole["loss"]).abs()),
             "logits": float((torch.cat(logits, 1) - whole["logits"]).abs().max()),
             "input_grad": float((torch.cat(input_grad, 1) / size - whole["input_grad"]).abs().max())}
    for key, grad in mine["grads"].items():
        worst[f"grad {key}"] = float((grad / size - whole["grads"][key]).abs().max())
    return worst


def worker(rank: int, world: int, port: int, out: str, models: list[str] = MODELS, sizes: tuple | None = None) -> None:
    """Each model run by N = world pieces, or by each N of `sizes` in turn, on every context group of N ranks side
    by side (as in data x context parallel training), the groups taking turns at the models. The errors, by model
    (by N, then model, where `sizes` is given), to `out`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = {pieces: join_context_group(pieces) for pieces in sizes or (world,)}  # on every rank, in one order
    wholes = {}

    def whole(name: str, group) -> dict | None:
        # The first rank of a group alone runs the whole window (the others would only repeat it), eagerly: what a
        # variant (recomputed, compiled) gives must be what the plain model gives.
        if group.index != 0:
            return None
        if name not in wholes:
            wholes[name] = run(build(name.partition(" ")[0]), windows())
        return wholes[name]

    errors = {}
    for pieces, group in groups.items():
        # Each N's blocks compiled afresh for its piece's shape, as in a run: a second shape would recompile them
        # with dynamic shapes (slowly), and a third fall past dynamo's recompile limit to eager.
        torch._dynamo.reset()
        replica, replicas, _ = layout(rank, world, pieces)
        for name in models[replica::replicas]:
            worst = compare(name, group, whole(name, group))
            if worst is not None:
                errors.setdefault(str(pieces), {})[name] = worst
    found = [None] * world if rank == 0 else None
    dist.gather_object(errors, found, dst=0)
    if rank == 0:
        merged = {str(pieces): {name: worst for e in found for name, worst in e.get(str(pieces), {}).items()}
                  for pieces in groups}
        with open(out, "w") as f:
            json.dump(merged if sizes else merged[str(world)], f)
    dist.destroy_process_group()


def every_size(rank: int, world: int, port: int, out: str) -> None:
    """The worker by 2 and by 4 pieces, on 4 ranks."""
    worker(rank, world, port, out, sizes=SIZES)


def compare_on(world: int, out, target=worker) -> dict:
    """`target` (a worker) on `world` gloo processes: its errors against one process, by model (or as it writes
    them)."""
    ranks = mp.start_processes(target, args=(world, free_port(), str(out)), nprocs=world, start_method="spawn",
                               join=False)
    deadline = time.time() + 300  # about 30 s alone; ranks whose collectives do not meet would wait for ever
    while not ranks.join(timeout=1):
        if time.time() > deadline:
            for process in ranks.processes:
                process.kill()
            raise AssertionError(f"{world} ranks did not finish in 300 s: collectives that do not meet?")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict:
    """{N: {model: its worst errors by N pieces}}, from one group of 4 processes."""
    return compare_on(max(SIZES), tmp_path_factory.mktemp("cp") / "errors.json", every_size)


@pytest.mark.parametrize(("world", "name"), [(world, name) for world in SIZES for name in MODELS])
def test_context_parallel_equals_one_process(errors, world, name):
    worst = errors[str(world)][name]
    assert len(worst) > 3, "no parameter gradient was compared"
    too_far = {key: value for key, value in worst.items() if not value <= 1e-10}
    assert not too_far, f"{name} on {world} ranks differs from one process: {too_far}"


def test_an_op_call_planned_first_inside_a_recomputed_block_leaves_its_recomputation_alike():
    """A worker that ran attention, gla and "mesa,swa recomputed" failed with a CheckpointError: the exchange asks a
    mixer its op's name, a call planned on the meta device and cached (lm.mixers.protocol), inside a block that
    activation checkpointing runs again. Planned first there, it saved tensors for a backward that the recomputation,
    which found it cached, did not save: in every process where no earlier run had planned it. Here in one process,
    the name asked first inside a recomputed block."""
    _planned_call.cache_clear()
    mixer = MIXERS["mesa"](16, 2, 8, 0, **options("mesa")).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64, requires_grad=True)

    def block(x):
        mixer.op_name()
        return mixer(x)[0]

    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert x.grad is not None


def test_context_groups_are_consecutive_ranks():
    assert [layout(rank, 8, 4) for rank in range(8)] == [(r // 4, 2, r % 4) for r in range(8)]
    assert [layout(rank, 4, 1) for rank in range(4)] == [(r, 4, 0) for r in range(4)]

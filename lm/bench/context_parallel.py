"""Activation memory per rank and tokens/s under context parallelism (`lm bench context`).

For each mixer and each number of pieces N, N processes (gloo on CPU, NCCL with one GPU each where there are as many)
train one forward and backward of the same model on the same windows of T tokens, each rank holding T / N of them
(lm.mixers.context_parallel). Memory: each rank's peak growth during that step (lm.bench.memory.allocated_peak_mib:
tracked CPU allocations, or torch's peak allocated memory on CUDA), after a short step has made the gradients, so what
is counted is what grows with the tokens: activations kept for the backward, the states that cross ranks, their
gradients. Speed: the step's wall time on the slowest rank, as tokens/s of the group, against N = 1 in the same run.
On a CPU with fewer cores than processes the ranks share cores, and the times say so much rather than what N GPUs do.
"""

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lm.bench.memory import allocated_peak_mib
from lm.bench.progress import each_run
from lm.bench.results import print_and_save
from lm.bench.train_speed import device_name
from lm.mixers import MIXERS
from lm.mixers.context_parallel import check_layout, join_context_group
from lm.model import LanguageModel, LMConfig
from lm.training.module import next_token_loss
from lm.util.errors import UserError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_step(rank: int, world: int, port: int, shape: dict, batch: int, T: int, out: str) -> None:
    """One rank: a warm-up step at a short length, then the measured step at T; its peak and time into out."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # the memory figures read the current device's
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, device_id=device if cuda
                                else None)
    torch.manual_seed(0)
    with device:
        model = LanguageModel(LMConfig(**shape))
    model.context = join_context_group(world) if world > 1 else None

    def step(length: int) -> None:
        windows = torch.randint(0, shape["vocab_size"], (batch, length + 1), device=device,
                                generator=torch.Generator(device).manual_seed(1))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = next_token_loss(model, windows)
        loss.backward()  # the gradients exist after the warm-up: this one adds into them

    step(8 * world)
    peak = allocated_peak_mib(lambda: step(T))
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    step(T)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak_mib": peak, "seconds": seconds}))
    if world > 1:
        dist.destroy_process_group()


def bench_context(mixers: list[str] = ["attention", "gated_deltanet", "mesa", "hawk"],  # noqa: B006
                  pieces: list[int] = [1, 2, 4], T: int = 16384, d_model: int = 128, n_layers: int = 2,  # noqa: B006
                  n_heads: int = 2, head_dim: int = 64, vocab_size: int = 4096, batch: int = 1,
                  json_out: str | None = None) -> dict:
    """Peak activation memory per rank and the group's tokens/s of one training step at T tokens, split over N ranks.

    Args:
        mixers: Mixer of every layer, one model per mixer (names in lm.mixers.MIXERS).
        pieces: The numbers of ranks N that share each window (1: one process, no context parallelism).
        T: Tokens per window; every N must divide it.
        d_model: Width of the residual stream.
        n_layers: Blocks.
        n_heads: Heads of each mixer.
        head_dim: Key size per head.
        vocab_size: Rows of the embedding.
        batch: Windows per step.
        json_out: Also write the result as JSON to this path.
    """
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown or not mixers:
        raise UserError(f"--mixers must be among {', '.join(sorted(MIXERS))} (unknown: {unknown})")
    if not pieces or batch < 1:
        raise UserError(f"--pieces must name numbers of pieces, and --batch be at least 1; got pieces {pieces}, "
                        f"batch {batch}")
    for n in pieces:
        check_layout(n, T, what="--pieces", window="--T")
    rows = []
    for mixer in each_run(mixers, "lm bench context"):
        shape = dict(mixer=mixer, d_model=d_model, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim,
                     vocab_size=vocab_size, max_seq_len=T)
        LMConfig(**shape)  # a bad shape is one line before any process starts
        for n in pieces:
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(rank_step, args=(n, free_port(), shape, batch, T, tmp), nprocs=n,
                                   start_method="spawn")
                ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(n)]
            rows.append({"mixer": mixer, "N": n, "tokens_per_rank": batch * T // n,
                         "peak_mib_per_rank": [r["peak_mib"] for r in ranks],
                         "seconds": max(r["seconds"] for r in ranks)})
    for r in rows:
        one = next(o for o in rows if o["mixer"] == r["mixer"] and o["N"] == min(pieces))
        r["tokens_per_s"] = batch * T / r["seconds"]
        r["memory_vs_fewest"] = max(r["peak_mib_per_rank"]) / max(one["peak_mib_per_rank"])
        r["speed_vs_fewest"] = one["seconds"] / r["seconds"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": device_name(device), "torch": torch.__version__, "cpus": os.cpu_count(), "T": T,
              "batch": batch, "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "head_dim": head_dim,
              "vocab_size": vocab_size, "rows": rows}
    print_and_save(result, json_out)
    print(f"\n| mixer | N | tokens per rank | peak MiB per rank (max) | vs N={min(pieces)} | tokens/s | "
          f"vs N={min(pieces)} |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mixer']} | {r['N']} | {r['tokens_per_rank']:,} | {max(r['peak_mib_per_rank']):.1f} | "
              f"{r['memory_vs_fewest']:.2f} | {r['tokens_per_s']:,.0f} | {r['speed_vs_fewest']:.2f} |")
    return result

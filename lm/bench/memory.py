"""Peak memory of a training step vs sequence length, per mixer (`lm bench memory`).

Each (mixer, T) trains one step of the same small model (every layer that mixer) on random tokens. On CUDA the
figure is the growth of torch's peak allocated memory during that step; on CPU it is the peak of the bytes torch's
CPU allocator has handed out and not yet taken back during that step (tracked_peak_bytes: every allocation and free,
as torch's profiler records them), not RSS, which also holds what malloc keeps for reuse, code pages and thread
stacks. Both count what grows with T: activations kept for the backward pass, the mixers' chunk states, gradients of
the activations. Weights, gradients and AdamW's moments exist before the measured step (a short step runs first).
"""

import gc

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from lm.bench.progress import each_run
from lm.bench.results import print_and_save
from lm.bench.train_speed import device_name
from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig
from lm.training.module import next_token_loss
from lm.util.errors import UserError

CPU_DEVICES = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)


def tracked_peak_bytes(fn) -> int:
    """How far the bytes that torch's CPU allocator has handed out (and not taken back) rise above their level at the
    start while fn() runs: torch's profiler records every allocation and free ("[memory]" events, +bytes and -bytes);
    their running sum in time order, at its maximum. Exact for what fn() allocates, whatever the process did before.
    A tensor allocated before fn() and freed inside it is not subtracted (the profiler never saw its size), so such a
    free can only raise the figure. Memory outside torch's allocator (malloc by libraries, code) is not counted."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() in CPU_DEVICES]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):  # stable: an allocation and its free keep their order
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def allocated_peak_mib(fn) -> float:
    """How far the memory that torch has allocated peaks above its current level while fn() runs, in MiB (CUDA:
    torch's peak allocated memory; CPU: tracked_peak_bytes)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    return tracked_peak_bytes(fn) / 2**20


def whole_logits_loss(model: LanguageModel, windows: torch.Tensor) -> torch.Tensor:
    """The loss as it was before the chunked head: the whole [batch, T, vocab] logits, then cross-entropy."""
    logits, _ = model(windows[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


LOSSES = {"chunked": next_token_loss, "whole": whole_logits_loss}


def step_peak_mib(cfg: LMConfig, T: int, batch: int, loss_name: str = "chunked") -> float:
    """Peak memory growth of one training step (forward, loss, backward, AdamW step) at length T, in MiB."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:
        model = LanguageModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(length: int):
        windows = torch.randint(0, cfg.vocab_size, (batch, length + 1), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = LOSSES[loss_name](model, windows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(min(T, 64))  # AdamW's moments exist before the measured step: they do not grow with T
    return allocated_peak_mib(lambda: step(T))


def bench_memory(mixers: list[str] | None = None,
                 lengths: list[int] = [512, 2048, 8192], d_model: int = 256, n_layers: int = 2,  # noqa: B006
                 n_heads: int = 4, head_dim: int = 64, vocab_size: int = 4096, batch: int = 1,
                 losses: list[str] = ["chunked"], json_out: str | None = None) -> dict:  # noqa: B006
    """Peak memory of one training step per mixer and sequence length; the growth per token shows whether it is
    linear in T.

    Args:
        mixers: Mixer of every layer, one model per mixer (names in lm.mixers.MIXERS; default: all).
        lengths: Sequence lengths T.
        d_model: Width of the residual stream.
        n_layers: Number of blocks.
        n_heads: Heads of each mixer.
        head_dim: Key size per head.
        vocab_size: Rows of the embedding (the logits are [batch, T, vocab] and grow with T too).
        batch: Sequences per step.
        losses: How the loss is taken: "chunked" (the model's head over chunks of tokens, lm's way) and/or "whole"
            (the whole logits, then cross-entropy: the way before it), each a row of its own.
        json_out: Also write the result as JSON to this path.
    """
    mixers = list(MIXERS) if mixers is None else mixers
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown or batch < 1 or min(lengths, default=0) < 1:
        raise UserError(f"mixers must be among {', '.join(sorted(MIXERS))} (unknown: {unknown}); batch and "
                        "lengths (at least one) must be >= 1")
    if not losses or set(losses) - set(LOSSES):
        raise UserError(f"losses must be among {', '.join(LOSSES)}, got {losses}")
    shape = dict(d_model=d_model, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim, vocab_size=vocab_size,
                 max_seq_len=max(lengths))
    rows = []
    for mixer in each_run(mixers, "lm bench memory"):
        cfg = LMConfig(mixer=mixer, **shape)
        for loss in losses:
            for T in lengths:
                mib = step_peak_mib(cfg, T, batch, loss)
                rows.append({"mixer": mixer, "loss": loss, "T": T, "peak_mib": mib,
                             "mib_per_1k_tokens": mib / (batch * T / 1000)})
    first = {}
    for r in rows:  # growth from the shortest length: T-fold for linear memory, T^2-fold for quadratic
        base = first.setdefault((r["mixer"], r["loss"]), r)
        r["growth_vs_shortest"] = r["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else None
        r["length_ratio"] = r["T"] / base["T"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "measure": "torch peak allocated" if device.type == "cuda" else "tracked CPU allocations (peak)", **shape,
              "batch": batch, "rows": rows}
    print_and_save(result, json_out)
    print("\n| mixer | loss | T | peak MiB | MiB / 1k tokens | growth vs shortest T (length ratio) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        growth = "–" if r["growth_vs_shortest"] is None else f"{r['growth_vs_shortest']:.2f}"
        print(f"| {r['mixer']} | {r['loss']} | {r['T']} | {r['peak_mib']:.1f} | {r['mib_per_1k_tokens']:.2f} "
              f"| {growth} ({r['length_ratio']:g}) |")
    return result

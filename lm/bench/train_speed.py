"""Training throughput per model and its MFU, every model measured in the same process.

MFU here is the model's training FLOP/s as spent (lm.accounting.flops.flops_spent_per_token: the analytic count, a
tolerance-stopped Mesa's CG steps as its telemetry reports them) over the best square-matmul FLOP/s this process
reaches on the same device, in the same precision: a ratio against measured peak, not a datasheet figure. A
datasheet peak (`peak_flops`, e.g. 989e12 for an H100/H200 in dense bf16) adds a second MFU column.

`--resets` also times every model with resets at document boundaries (data.reset_at_documents), steps with and
without resets alternating on the same model and tokens, and reports their ratio: what resetting costs.

`--in_turn` builds every model of a length first and lets their timed steps take turns, one step each a round: on a
shared machine, whose load changes over minutes, that is what makes the models' ratios mean something.
"""

import platform
import time
from collections.abc import Callable

import torch

from lm.accounting.flops import flops_spent_per_token
from lm.bench.progress import bench_bar
from lm.bench.results import print_and_save
from lm.model import LanguageModel, LMConfig
from lm.training.config import parse_run_config
from lm.training.module import next_token_loss
from lm.util.errors import UserError
from lm.util.output import write_json


def sync(device: torch.device):
    # CUDA kernels run asynchronously: wait for them before reading the clock.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def matmul_flops_per_s(device: torch.device, repeats: int = 3) -> float:
    """Best FLOP/s of square matmuls: fp32 on CPU, bf16 on CUDA (the precision training runs in there)."""
    dtype, sizes = (torch.bfloat16, (4096, 8192)) if device.type == "cuda" else (torch.float32, (1024, 2048))
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b  # first call pays for allocation and kernel selection
        sync(device)
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            sync(device)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def model_configs(mixers: list[str], d_model: list[int], configs: list[str] | None, **shape) -> list[tuple]:
    """(label, LMConfig) of every model to time: the `model` section of each run config, else every
    (mixer, width) pair at the given shape."""
    if configs:
        return [(path, parse_run_config(["--config", path])[0].model) for path in configs]
    n_heads = shape.pop("n_heads")
    return [(f"{m} d{d}", LMConfig(mixer=m, d_model=d, n_heads=n_heads or max(1, d // shape["head_dim"]), **shape))
            for m in mixers for d in d_model]


def packed_windows(vocab_size: int, batch: int, seq_len: int, doc_len: int, device: torch.device) -> torch.Tensor:
    """Random tokens [batch, seq_len + 1] with the separator (id 0) starting a document every doc_len tokens on
    average, at random places (seeded)."""
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(1, vocab_size, (batch, seq_len + 1), generator=g)
    windows[torch.rand(batch, seq_len + 1, generator=g) < 1 / doc_len] = 0
    return windows.to(device)


def time_training(cfg: LMConfig, device: torch.device, seq_len: int, batch: int, steps: int, warmup: int,
                  activation_checkpointing: bool, resets: bool = False, doc_len: int = 512) -> dict:
    """Tokens/s of full training steps (forward, loss, backward, AdamW step, zero_grad) on random tokens. With
    `resets`, steps with resets at a separator (model.document_separator) alternate with steps without, on the same
    tokens, and the result adds their tokens/s and the ratio (resets / none)."""
    return time_in_turn([cfg], device, seq_len, batch, steps, warmup, activation_checkpointing, resets, doc_len)[0]


def time_in_turn(cfgs: list[LMConfig], device: torch.device, seq_len: int, batch: int, steps: int, warmup: int,
                 activation_checkpointing: bool, resets: bool = False, doc_len: int = 512,
                 on_step: Callable[[str], None] = lambda group: None) -> list[dict]:
    """`time_training` of several models built side by side, whose timed steps take turns (each model one step a
    round), so that a shared machine's changing load falls on all of them alike and their ratios mean something.
    Peak memory is then that of all the models together. `on_step(group)` after each step of a model, outside the
    timing ("warm-up" or "timed"): the progress bar's."""
    steppers = [training_step(cfg, device, packed_windows(cfg.vocab_size, batch, seq_len, doc_len, device),
                              activation_checkpointing) for cfg in cfgs]
    settings = (None, 0) if resets else (None,)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first_step_s = [None] * len(cfgs)
    for i, (_, train_step) in enumerate(steppers):
        t0 = time.perf_counter()
        for w in range(warmup):
            for separator in settings:
                train_step(separator)
            if w == 0:
                sync(device)
                first_step_s[i] = time.perf_counter() - t0  # with the compiling and autotuning of kernels
            on_step("warm-up")
    sync(device)
    seconds = [dict.fromkeys(settings, 0.0) for _ in cfgs]
    spent = [0.0] * len(cfgs)
    for _ in range(steps):
        for i, (model, train_step) in enumerate(steppers):
            for separator in settings:  # alternating, so that drifting machine load hits both alike
                t0 = time.perf_counter()
                train_step(separator)
                sync(device)
                seconds[i][separator] += time.perf_counter() - t0
                if separator is None:  # as the step ran: a tolerance-stopped Mesa's CG steps from its telemetry
                    spent[i] += flops_spent_per_token(model, seq_len, training=True)
            on_step("timed")
    tokens = batch * seq_len * steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    results = []
    for (model, _), secs, flops, first in zip(steppers, seconds, spent, first_step_s):
        result = {"params": model.num_params(), "tokens_per_s": tokens / secs[None], "peak_mem_gib": peak,
                  "step_s": secs[None] / steps, "first_step_s": first, "model_flops_per_token": flops / steps}
        if resets:
            result.update(reset_tokens_per_s=tokens / secs[0], reset_ratio=secs[None] / secs[0])
        results.append(result)
    return results


def training_step(cfg: LMConfig, device: torch.device, windows: torch.Tensor, activation_checkpointing: bool):
    """(model, step): a model built on the device, and a function that runs one full training step of it on
    `windows` with the given document separator (None: no resets)."""
    with device:  # build the weights on the device itself: a 1B model initialised on the CPU takes a while
        model = LanguageModel(cfg)
    model.activation_checkpointing = activation_checkpointing
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(separator: int | None):
        model.cfg.document_separator = separator  # the model reads it at each forward
        # bf16 autocast on CUDA matches the bf16 matmul peak; CPU stays fp32 like its peak.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = next_token_loss(model, windows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, train_step


def bench_train(mixers: list[str] = ["attention"], d_model: list[int] = [256],  # noqa: B006
                seq_len: list[int] = [256], configs: list[str] | None = None, n_layers: int = 4,  # noqa: B006
                n_heads: int | None = None, head_dim: int = 64, vocab_size: int = 8192, batch: int = 8,
                batch_tokens: int | None = None, steps: int = 10, warmup: int = 2, peak_flops: float | None = None,
                activation_checkpointing: bool = False, budget_s: float | None = None, threads: int | None = None,
                resets: bool = False, doc_len: int = 512, in_turn: bool = False, json_out: str | None = None) -> dict:
    """Time full training steps of each model at each length on random tokens; report tokens/s and MFU.

    Args:
        mixers: Sequence mixer of every layer, one model per mixer (names in lm.mixers.MIXERS).
        d_model: Widths of the residual stream, one model per width and mixer.
        seq_len: Tokens per training sequence; every model runs at every length.
        configs: Run config YAMLs whose `model` section to time instead of mixers x d_model (e.g. the paper
            sizes in configs/MIXER/400m.yaml); the shape options below then do not apply.
        n_layers: Number of blocks.
        n_heads: Heads of each mixer; None: d_model // head_dim.
        head_dim: Key size per head.
        vocab_size: Rows of the embedding (and of the tied output head).
        batch: Sequences per step.
        batch_tokens: Tokens per step instead of batch: batch = max(1, batch_tokens // seq_len).
        steps: Timed training steps.
        warmup: Untimed training steps run first (allocation, kernel selection).
        peak_flops: Datasheet peak FLOP/s of the device; adds MFU against it (None: only the measured peak).
        activation_checkpointing: Recompute each block in the backward pass (less memory, about 1/3 more work
            that MFU does not count).
        budget_s: Skip the models and lengths not yet started once this many seconds have passed (rows
            marked "skipped"); None: no limit.
        threads: CPU threads for torch (torch.set_num_threads); None keeps torch's default.
        resets: Also time every model with resets at document boundaries (steps alternating with plain ones) and
            report the ratio of their speeds: 0.9 means resetting costs 10%.
        doc_len: Mean document length of the packed windows that --resets times.
        in_turn: At each length, build every model first and let their timed steps take turns (one step each a
            round), so that the changing load of a shared machine falls on all alike: their ratios then mean
            something. Peak memory is then that of all the models together.
        json_out: Also write the result as JSON to this path.
    """
    if doc_len < 1:
        raise UserError(f"--doc_len must be at least 1, got {doc_len}")
    if steps < 1 or warmup < 0 or batch < 1 or min(seq_len, default=0) < 1 or (batch_tokens or 1) < 1:
        raise UserError(f"need steps >= 1, warmup >= 0, batch >= 1, batch_tokens >= 1 and at least one seq_len, "
                        f"all >= 1; got {steps}, {warmup}, {batch}, {batch_tokens}, {seq_len}")
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = model_configs(mixers, d_model, configs, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim,
                           vocab_size=vocab_size, max_seq_len=max(seq_len))
    peak = matmul_flops_per_s(device)
    result_of = lambda rows: {  # noqa: E731
        "device": device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": "bf16 autocast" if device.type == "cuda" else "fp32", "steps": steps, "warmup": warmup,
        "matmul_flops_per_s": peak, "peak_flops": peak_flops, "activation_checkpointing": activation_checkpointing,
        "resets": resets, "doc_len": doc_len, "in_turn": in_turn, "rows": rows}
    rows, cfgs = [], []
    for label, cfg in models:
        for T in seq_len:
            b = max(1, batch_tokens // T) if batch_tokens else batch
            rows.append({"model": label, "mixer": ",".join(sorted(set(cfg.layer_mixers()))), "d_model": cfg.d_model,
                         "n_layers": cfg.n_layers, "seq_len": T, "batch": b, "status": "ok"})
            cfgs.append(cfg)
    # The rows timed together (their indices): each alone, or with in_turn all the models at one length.
    groups = [[i for i, r in enumerate(rows) if r["seq_len"] == T] for T in dict.fromkeys(seq_len)] if in_turn \
        else [[i] for i in range(len(rows))]
    # On stderr, each model's steps: a line as each group starts, and as its steps go (lm.bench.progress).
    bar, done = bench_bar(len(rows) * (warmup + steps), "lm bench train"), 0
    for group in groups:
        done += len(group) * (warmup + steps)
        T, b = rows[group[0]]["seq_len"], rows[group[0]]["batch"]
        names = rows[group[0]]["model"] if len(group) == 1 else f"{len(group)} models in turn"
        bar.set_description(f"lm bench train: {names}, seq_len {T}")
        if budget_s is not None and time.perf_counter() - started > budget_s:
            for i in group:
                rows[i]["status"] = "skipped"
            bar.update(done - bar.n)
            continue
        try:
            timed = time_in_turn([cfgs[i] for i in group], device, T, b, steps, warmup, activation_checkpointing,
                                 resets, doc_len, on_step=lambda step_group: (bar.set_postfix_str(step_group, False),
                                                                            bar.update()))
        except torch.OutOfMemoryError:
            timed = [None] * len(group)
        bar.update(done - bar.n)  # the steps an out-of-memory left undone
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for row, result in zip((rows[i] for i in group), timed):
            if result is None:
                row["status"] = "out of memory"
                continue
            row.update(result)
            flops = row["model_flops_per_token"]
            row.update(model_flops_per_s=flops * row["tokens_per_s"],
                       mfu=flops * row["tokens_per_s"] / peak,
                       mfu_datasheet=flops * row["tokens_per_s"] / peak_flops if peak_flops else None)
        if json_out:  # what is done so far, should a time limit stop the rest
            write_json(json_out, result_of(rows))
    bar.close()
    result = result_of(rows)
    print_and_save(result, json_out)
    print_table(result)
    return result


def print_table(result: dict) -> None:
    datasheet, resets = result["peak_flops"] is not None, result.get("resets", False)
    print(f"\n{result['device']}, {result['dtype']}, measured matmul peak "
          f"{result['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s" +
          (f", datasheet peak {result['peak_flops'] / 1e12:,.0f} TFLOP/s" if datasheet else ""))
    print("\n| model | params | seq_len | batch | tokens/s | model GFLOP/s | MFU (measured peak) |"
          + (" MFU (datasheet) |" if datasheet else "") + " peak memory GiB | first step s (a step s) |"
          + (" tokens/s with resets | with / without |" if resets else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if datasheet else "") + "---|---|" + ("---|---|" if resets else ""))
    for r in result["rows"]:
        if r["status"] != "ok":
            print(f"| {r['model']} | – | {r['seq_len']} | {r['batch']} | {r['status']} | | |"
                  + (" |" if datasheet else "") + " | |" + (" | |" if resets else ""))
            continue
        mem = "–" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        first = "–" if r.get("first_step_s") is None else f"{r['first_step_s']:.2f} ({r['step_s']:.2f})"
        print(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['seq_len']} | {r['batch']} | {r['tokens_per_s']:,.0f} "
              f"| {r['model_flops_per_s'] / 1e9:,.1f} | {r['mfu']:.1%} |"
              + (f" {r['mfu_datasheet']:.1%} |" if datasheet else "") + f" {mem} | {first} |"
              + (f" {r['reset_tokens_per_s']:,.0f} | {r['reset_ratio']:.3f} |" if resets else ""))

"""Training throughput per model and its MFU, every model measured in the same process.

MFU here is the model's training FLOP/s as spent (lm.accounting.flops.flops_spent_per_token: the analytic count, a
tolerance-stopped Mesa's CG steps as its telemetry reports them) over the best square-matmul FLOP/s this process
reaches on the same device, in the same precision: a ratio against measured peak, not a datasheet figure. A
datasheet peak (`peak_flops`, e.g. 989e12 for an H100/H200 in dense bf16) adds a second MFU column.

`--resets` also times every model with resets at document boundaries (data.reset_at_documents), steps with and
without resets alternating on the same model and tokens, and reports their ratio: what resetting costs.
"""

import platform
import time

import torch

from lm.accounting.flops import flops_spent_per_token
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
    with device:  # build the weights on the device itself: a 1B model initialised on the CPU takes a while
        model = LanguageModel(cfg)
    model.activation_checkpointing = activation_checkpointing
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    windows = packed_windows(cfg.vocab_size, batch, seq_len, doc_len, device)

    def train_step(separator: int | None):
        model.cfg.document_separator = separator  # the model reads it at each forward
        # bf16 autocast on CUDA matches the bf16 matmul peak; CPU stays fp32 like its peak.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = next_token_loss(model, windows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    settings = (None, 0) if resets else (None,)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for i in range(warmup):
        for separator in settings:
            train_step(separator)
        if i == 0:
            sync(device)
            first_step_s = time.perf_counter() - t0  # with the compiling and autotuning of kernels for this shape
    sync(device)
    seconds, spent = dict.fromkeys(settings, 0.0), 0.0
    for _ in range(steps):
        for separator in settings:  # alternating, so that drifting machine load hits both alike
            t0 = time.perf_counter()
            train_step(separator)
            sync(device)
            seconds[separator] += time.perf_counter() - t0
            if separator is None:  # as the step ran: a tolerance-stopped Mesa's CG steps from its telemetry
                spent += flops_spent_per_token(model, seq_len, training=True)
    tokens = batch * seq_len * steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    step_s = seconds[None] / steps
    result = {"params": model.num_params(), "tokens_per_s": tokens / seconds[None], "peak_mem_gib": peak,
              "step_s": step_s, "first_step_s": first_step_s if warmup else None,
              "model_flops_per_token": spent / steps}
    if resets:
        result.update(reset_tokens_per_s=tokens / seconds[0], reset_ratio=seconds[None] / seconds[0])
    return result


def bench_train(mixers: list[str] = ["attention"], d_model: list[int] = [256],  # noqa: B006
                seq_len: list[int] = [256], configs: list[str] | None = None, n_layers: int = 4,  # noqa: B006
                n_heads: int | None = None, head_dim: int = 64, vocab_size: int = 8192, batch: int = 8,
                batch_tokens: int | None = None, steps: int = 10, warmup: int = 2, peak_flops: float | None = None,
                activation_checkpointing: bool = False, budget_s: float | None = None, threads: int | None = None,
                resets: bool = False, doc_len: int = 512, json_out: str | None = None) -> dict:
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
    rows = []
    result_of = lambda rows: {  # noqa: E731
        "device": device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": "bf16 autocast" if device.type == "cuda" else "fp32", "steps": steps, "warmup": warmup,
        "matmul_flops_per_s": peak, "peak_flops": peak_flops, "activation_checkpointing": activation_checkpointing,
        "resets": resets, "doc_len": doc_len, "rows": rows}
    for label, cfg in models:
        for T in seq_len:
            b = max(1, batch_tokens // T) if batch_tokens else batch
            row = {"model": label, "mixer": ",".join(sorted(set(cfg.layer_mixers()))), "d_model": cfg.d_model,
                   "n_layers": cfg.n_layers, "seq_len": T, "batch": b, "status": "ok"}
            rows.append(row)
            if budget_s is not None and time.perf_counter() - started > budget_s:
                row["status"] = "skipped"
                continue
            try:
                row.update(time_training(cfg, device, T, b, steps, warmup, activation_checkpointing, resets, doc_len))
            except torch.OutOfMemoryError:
                row["status"] = "out of memory"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if row["status"] != "ok":
                continue
            flops = row["model_flops_per_token"]
            row.update(model_flops_per_s=flops * row["tokens_per_s"],
                       mfu=flops * row["tokens_per_s"] / peak,
                       mfu_datasheet=flops * row["tokens_per_s"] / peak_flops if peak_flops else None)
            if json_out:  # what is done so far, should a time limit stop the rest
                write_json(json_out, result_of(rows))
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

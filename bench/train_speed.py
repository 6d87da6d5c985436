"""Training throughput of one model and its MFU, both measured in the same process.

MFU here is the model's analytic training FLOP/s (lm.flops) over the best square-matmul FLOP/s this process
reaches on the same device, in the same precision: a ratio against measured peak, not a datasheet figure.
"""

import json
import platform
import time

import torch

from lm.errors import UserError
from lm.flops import train_flops_per_token
from lm.model import LanguageModel, LMConfig
from lm.module import next_token_loss


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


def bench_train(d_model: int = 256, n_layers: int = 4, n_heads: int = 4, head_dim: int = 64, vocab_size: int = 8192,
                seq_len: int = 256, batch: int = 8, steps: int = 10, warmup: int = 2, mixer: str = "attention",
                threads: int | None = None, json_out: str | None = None) -> dict:
    """Time full training steps of a model on random tokens; report tokens/s and MFU.

    Args:
        d_model: Width of the residual stream.
        n_layers: Number of blocks.
        n_heads: Heads of each mixer.
        head_dim: Key size per head.
        vocab_size: Rows of the embedding (and of the tied output head).
        seq_len: Tokens per training sequence.
        batch: Sequences per step.
        steps: Timed training steps.
        warmup: Untimed training steps run first (allocation, kernel selection).
        mixer: Sequence mixer of every layer (a name in lm.mixers.MIXERS).
        threads: CPU threads for torch (torch.set_num_threads); None keeps torch's default.
        json_out: Also write the result as JSON to this path.
    """
    if steps < 1 or warmup < 0 or batch < 1 or seq_len < 1:
        raise UserError(f"need steps >= 1, warmup >= 0, batch >= 1, seq_len >= 1; got {steps}, {warmup}, "
                        f"{batch}, {seq_len}")
    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = matmul_flops_per_s(device)

    cfg = LMConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim,
                   mixer=mixer, max_seq_len=seq_len)
    model = LanguageModel(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    windows = torch.randint(0, vocab_size, (batch, seq_len + 1), device=device)

    def train_step():
        # bf16 autocast on CUDA matches the bf16 matmul peak; CPU stays fp32 like its peak.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = next_token_loss(model, windows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        train_step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step()
    sync(device)
    tokens_per_s = batch * seq_len * steps / (time.perf_counter() - t0)

    flops_per_token = train_flops_per_token(cfg, seq_len)
    result = {
        "device": device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "params": model.num_params(), "d_model": d_model, "n_layers": n_layers, "seq_len": seq_len, "batch": batch,
        "tokens_per_s": tokens_per_s, "model_flops_per_token": flops_per_token,
        "model_flops_per_s": flops_per_token * tokens_per_s, "matmul_flops_per_s": peak,
        "mfu": flops_per_token * tokens_per_s / peak,
    }
    print(json.dumps(result, indent=2))
    print("\n| device | params | d_model | n_layers | seq_len | batch | tokens/s | model GFLOP/s "
          "| matmul GFLOP/s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {result['device']} | {result['params'] / 1e6:.2f}M | {d_model} | {n_layers} | {seq_len} | {batch} "
          f"| {tokens_per_s:,.0f} | {result['model_flops_per_s'] / 1e9:.1f} | {peak / 1e9:.1f} "
          f"| {result['mfu']:.1%} |")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=2)
    return result

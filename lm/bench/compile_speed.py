"""`lm bench compile`: eager against torch.compile'd training steps, per mixer, in one process.

Each mixer's model is built twice with the same weights: one runs eagerly, the other has every block compiled the way
`trainer.compile` does it (`block.compile()`, LMModule.configure_model). A step is forward, loss and backward on fixed
random tokens. The first compiled step (tracing and code generation, forward and backward) is the compile time; then
the two models take turns (lm/bench/timing.py), and each side's best step counts. Inductor's on-disk cache starts empty
(a temporary directory), so the first mixer's compile time is a cold one. The graph breaks are counted by
torch._dynamo.explain on one block's forward, with their reasons. On CUDA the steps run under bf16 autocast, as
bf16-mixed training does, and each row is written to the JSON as it ends, so that a time limit keeps the finished
rows.
"""

import contextlib
import copy
import os
import tempfile
import time

import torch
import torch._dynamo

from lm.bench.progress import each_run
from lm.bench.results import print_and_save
from lm.bench.timing import best_interleaved
from lm.bench.train_speed import device_name, packed_windows, sync
from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig
from lm.training.module import next_token_loss
from lm.util.errors import UserError
from lm.util.output import write_json


def graph_breaks(block: torch.nn.Module, x: torch.Tensor) -> tuple[int, list[str]]:
    """(graph breaks, their distinct reasons as 'reason @ file:line') of one forward of `block` on x."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(x)
    reasons = []
    for b in explained.break_reasons:
        frame = b.user_stack[-1] if b.user_stack else None
        where = f" @ {os.path.relpath(frame.filename)}:{frame.lineno}" if frame else ""
        reason = b.reason.splitlines()[0] + where
        if reason not in reasons:
            reasons.append(reason)
    torch._dynamo.reset()
    return explained.graph_break_count, reasons


def compare(cfg: LMConfig, windows: torch.Tensor, repeats: int, backend: str) -> dict:
    """One mixer's row: eager and compiled step times, first compiled step, loss difference, graph breaks."""
    device = windows.device
    eager = LanguageModel(cfg).to(device)
    compiled = copy.deepcopy(eager)
    for block in compiled.blocks:
        block.compile(backend=backend)

    def step(model):
        with torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext():
            loss = next_token_loss(model, windows)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    eager_loss = step(eager)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    compiled_loss = step(compiled)
    sync(device)
    first_s = time.perf_counter() - t0
    best = best_interleaved({"eager": lambda: step(eager), "compiled": lambda: step(compiled)}, repeats, device)
    with torch.no_grad():
        x = eager.embed(windows[:, :-1])
    breaks, reasons = graph_breaks(eager.blocks[0], x)
    return {"params": eager.num_params(), "eager_ms": 1e3 * best["eager"], "compiled_ms": 1e3 * best["compiled"],
            "speedup": best["eager"] / best["compiled"], "first_compiled_step_s": first_s,
            "loss_diff": float((eager_loss - compiled_loss).abs()), "graph_breaks": breaks, "break_reasons": reasons}


def bench_compile(mixers: list[str] | None = None, d_model: int = 256, n_layers: int = 2, head_dim: int = 64,
                  seq_len: int = 256, batch: int = 2, vocab_size: int = 4096, repeats: int = 3,
                  backend: str = "inductor", json_out: str | None = None) -> dict:
    """Eager vs compiled training steps (forward, loss, backward) per mixer: speedup, compile time, graph breaks.

    Args:
        mixers: Mixers to compare (names in lm.mixers.MIXERS; default: all of them).
        d_model: Model width; heads of head_dim (d_model / head_dim heads).
        n_layers: Blocks, every one the same mixer, each compiled on its own.
        head_dim: Head size.
        seq_len: Tokens per row.
        batch: Rows per step.
        vocab_size: Vocabulary size.
        repeats: Timed steps per side after the first, taking turns; the best counts.
        backend: torch.compile backend ("inductor" as trainer.compile; "aot_eager_decomp_partition" traces
            and partitions without generating code, as the tests do).
        json_out: Also write the result as JSON to this path.

    A mixer whose compiled step fails gets a row with status "failed: <error>" and the others go on.
    """
    mixers = list(MIXERS) if mixers is None else mixers
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown or repeats < 1 or min(d_model, n_layers, head_dim, seq_len, batch) < 1:
        raise UserError(f"--mixers must be among {', '.join(MIXERS)} (unknown: {unknown}); sizes and repeats >= 1")
    rows = []
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "dtype": "bf16 autocast" if device.type == "cuda" else "fp32", "backend": backend, "d_model": d_model,
              "n_layers": n_layers, "head_dim": head_dim, "seq_len": seq_len, "batch": batch,
              "vocab_size": vocab_size, "repeats": repeats, "rows": rows}
    old_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # a cold compile, not one served from an earlier run's cache
        try:
            for mixer in each_run(mixers, "lm bench compile"):
                torch.manual_seed(0)
                cfg = LMConfig(mixer=mixer, d_model=d_model, n_layers=n_layers, n_heads=max(1, d_model // head_dim),
                               head_dim=head_dim, vocab_size=vocab_size, max_seq_len=seq_len)
                windows = packed_windows(vocab_size, batch, seq_len, seq_len, device)
                torch._dynamo.reset()
                try:
                    row = {"mixer": mixer, "status": "ok", **compare(cfg, windows, repeats, backend)}
                except Exception as err:  # noqa: BLE001  (a failing mixer is a result; the others go on)
                    row = {"mixer": mixer, "status": f"failed: {type(err).__name__}: {str(err).splitlines()[0]}"}
                rows.append(row)
                if json_out:  # what is done so far, should a time limit stop the rest
                    write_json(json_out, result)
        finally:
            torch._dynamo.reset()
            if old_cache is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old_cache

    print_and_save(result, json_out)
    print("\n| mixer | params | eager ms | compiled ms | eager / compiled | first compiled step s | graph breaks "
          "| loss diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['mixer']} | {r['status']} | | | | | | |")
            continue
        print(f"| {r['mixer']} | {r['params'] / 1e6:.2f}M | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} "
              f"| {r['speedup']:.2f} | {r['first_compiled_step_s']:.1f} | {r['graph_breaks']} | {r['loss_diff']:.1e} |")
    for r in rows:
        for reason in r.get("break_reasons", []):
            print(f"- {r['mixer']}: {reason}")
    return result

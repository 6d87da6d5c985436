"""FlexAttention against SDPA for attention's masks (lm.mixers.flex_masks), on the sequence op alone: q, k, v
[batch, heads, T, head_dim] in float32 and a sliding window of T/2 or 128 keys, or documents of 256 tokens. SDPA takes
the dense boolean mask that `kernel: sdpa` builds; FlexAttention the block mask.

    python -m lm.bench.flex_speed [--lengths 512,2048] [--masks half,128,docs256] [--repeats 3] [--threads N]

Rows: forward alone (no gradients: on the CPU, torch's compiled C++ FlexAttention kernel, float32) and forward +
backward (on the CPU, FlexAttention's math form, the only one with a backward there). On CUDA both are the compiled
Triton kernel. Compile time is not in the timings: one call of each comes first, and the last column gives that call of
FlexAttention's (compiling it for the shape, where it is compiled).
"""

import argparse
import functools
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from lm.bench.timing import best_interleaved
from lm.mixers.flex_masks import attention_block_mask, attention_mask_mod, flex_attend
from lm.util.output import write_json


def mask_for(spec: str, T: int) -> tuple[int | None, torch.Tensor | None]:
    """(window, document_start [1, T]) of a mask named "half" (a window of T/2), "docsN" (documents of N tokens) or
    a number (a window of that many keys)."""
    if spec == "half":
        return T // 2, None
    if spec.startswith("docs"):
        size = int(spec[len("docs"):])
        return None, (torch.arange(T) // size * size)[None]
    return int(spec), None


def forward_backward(attend, q, k, v, grad):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    (attend(q, k, v) * grad).sum().backward()


def forward_only(attend, q, k, v):
    with torch.no_grad():
        attend(q, k, v)


def bench_flex(lengths: list[int] = [512, 2048], masks: list[str] = ["half", "128", "docs256"],  # noqa: B006
               batch: int = 1, n_heads: int = 4, head_dim: int = 64, repeats: int = 3,
               device: str | None = None) -> list[dict]:
    """Milliseconds of SDPA (dense mask) and of FlexAttention (block mask), forward alone and forward + backward,
    best of `repeats` rounds that take turns (lm/bench/timing.py)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for T in lengths:
        for spec in masks:
            window, document_start = mask_for(spec, T)
            document_start = None if document_start is None else document_start.to(device)
            mask_mod = attention_mask_mod(0, window, document_start)
            dense = create_mask(mask_mod, 1, 1, T, T, device=device)  # what Attention.allowed builds
            block_mask = attention_block_mask(T, 0, window, document_start, device)
            q, k, v, grad = (torch.randn(batch, n_heads, T, head_dim, device=device) for _ in range(4))
            sdpa = functools.partial(F.scaled_dot_product_attention, attn_mask=dense)
            flex = functools.partial(flex_attend, block_mask=block_mask, window=window,
                                     documents=document_start is not None)
            for form, run in (("forward", forward_only), ("forward + backward", forward_backward)):
                extra = () if form == "forward" else (grad,)
                calls = {name: functools.partial(run, attend, q, k, v, *extra)
                         for name, attend in (("sdpa", sdpa), ("flex", flex))}
                first = {}
                for name, call in calls.items():  # compile, and warm up
                    start = time.perf_counter()
                    call()
                    first[name] = time.perf_counter() - start
                best = best_interleaved(calls, repeats, device)
                skipped = block_mask.sparsity()  # percent of the blocks that are not computed
                rows.append({"T": T, "mask": spec, "form": form, "sdpa_ms": 1e3 * best["sdpa"],
                             "flex_ms": 1e3 * best["flex"], "sdpa_over_flex": best["sdpa"] / best["flex"],
                             "blocks_skipped_percent": skipped, "flex_first_call_s": first["flex"],
                             "device": device.type})
    print(f"| T | mask | form | SDPA ms | flex ms | SDPA / flex | blocks skipped | flex first call s ({device.type}) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['mask']} | {r['form']} | {r['sdpa_ms']:.1f} | {r['flex_ms']:.1f} | "
              f"{r['sdpa_over_flex']:.2f} | {r['blocks_skipped_percent']:.0f}% | {r['flex_first_call_s']:.1f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--masks", default="half,128,docs256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own choice)")
    parser.add_argument("--json_out")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench_flex([int(t) for t in args.lengths.split(",")], args.masks.split(","), repeats=args.repeats)
    if args.json_out:
        write_json(args.json_out, rows, indent=1)


if __name__ == "__main__":
    main()

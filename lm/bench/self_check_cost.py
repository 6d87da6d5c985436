"""What the fast paths' self-check (lm.ops.self_check) costs, for Mesa's Triton kernels: the seconds of one check (the
kernels and the torch code, forward and backward, on its small seeded input: one row, two heads, two of the kernels'
chunks and an odd tail), next to those of the call that triggers it, which runs it once per process and shape class.

    TRITON_INTERPRET=1 lm bench self-check [--K 16] [--T 64] [--chunk 16] [--repeats 3]

Without TRITON_INTERPRET, on a machine with CUDA, the compiled kernels ("auto"); the first check there also pays for
compiling them, which the call would pay anyway. Best of `repeats` (the verdict is forgotten before each).
"""

import os
import time

import torch
import torch.nn.functional as F

from lm.bench.results import print_and_save
from lm.ops import self_check
from lm.ops.mesa import mesa
from lm.util.errors import UserError


def measure(K: int = 16, T: int = 64, chunk: int = 16, repeats: int = 3, device: str | None = None) -> dict:
    """{"check_s": best seconds of one check, "call_s": best seconds of the call (forward and backward) without one,
    "worst_relative_error": the check's largest error against the torch code, "device", "backend"}."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "auto"
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device)
    x = dict(q=F.normalize(rand(2, T, 2, K), dim=-1), k=F.normalize(rand(2, T, 2, K), dim=-1), v=rand(2, T, 2, K),
             log_gamma=F.logsigmoid(rand(2, T, 2) + 3), beta=torch.sigmoid(rand(2, T, 2)),
             lam=0.25 + F.softplus(rand(2, K)))

    def call():
        leaves = [t.clone().requires_grad_() for t in x.values()]
        out, _ = mesa(*leaves, chunk_size=chunk, backend=backend)
        out.square().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    checks, calls, worst = [], [], 0.0
    for _ in range(repeats):
        self_check.forget()
        call()  # checks, then runs
        [verdict] = self_check.verdicts().values()
        checks.append(verdict.seconds)
        worst = max(worst, *(error for error, _, _ in verdict.errors.values()))
        start = time.perf_counter()
        call()
        calls.append(time.perf_counter() - start)
    return {"check_s": min(checks), "call_s": min(calls), "worst_relative_error": worst, "device": device,
            "backend": backend}


def bench_self_check(K: int = 16, T: int = 64, chunk: int = 16, repeats: int = 3,
                     json_out: str | None = None) -> dict:
    """One self-check of Mesa's Triton kernels against the call it guards (TRITON_INTERPRET=1 on a CPU).

    Args:
        K: Head size (K = V).
        T: The timed call's length (batch 2, 2 heads).
        chunk: Chunk size.
        repeats: Best of this many.
        json_out: Also write the result as JSON here.
    """
    if min(K, T, chunk, repeats) < 1:
        raise UserError(f"--K, --T, --chunk and --repeats must be at least 1, got {K}, {T}, {chunk}, {repeats}")
    result = measure(K, T, chunk, repeats)
    print_and_save(result, json_out)
    return result

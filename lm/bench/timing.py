"""Best-of-n wall times of several calls that take turns, so that a noisy (shared) machine slows them alike."""

import math
import time
from collections.abc import Callable

import torch

from lm.bench.train_speed import sync


def best_interleaved(calls: dict[str, Callable[[], None]], repeats: int, device: torch.device) -> dict[str, float]:
    """Best wall seconds of each call over `repeats` rounds; in each round every call runs once, in alternating
    order, so a slow spell of a shared machine falls on both sides rather than on one."""
    best = dict.fromkeys(calls, math.inf)
    for r in range(repeats):
        for name in list(calls) if r % 2 == 0 else reversed(list(calls)):
            sync(device)
            t0 = time.perf_counter()
            calls[name]()
            sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best

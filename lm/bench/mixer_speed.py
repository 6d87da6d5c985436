"""Speed and memory of the sequence ops behind the recurrent mixers: chunkwise form (training) vs recurrent form.

Each mixer's op gets the head shapes its module builds for (d_model, n_heads, head_dim) and the inputs the module feeds
it for a random input (the mixer's `bench_op`: its op call through its own projections at init). Timings are forward +
backward. Peak memory is the peak of the tensor memory allocated during one chunkwise forward + backward (torch's
allocations, tracked; lm.bench.memory).

A mixer's VARIANTS (below) add rows with other options (Mesa: fewer CG steps, early stopping at a tolerance), each
compared with its REFERENCE mixer at the same (d_model, n_heads, head_dim) when that one runs too; the
recurrent form and the peak memory are measured for the default row only (Mesa's recurrent form, a CG solve per
step, is by far the slowest loop).
"""

import math
import time

import torch

from lm.bench.memory import allocated_peak_mib
from lm.bench.progress import each_run
from lm.bench.results import print_and_save
from lm.bench.train_speed import device_name
from lm.mixers import MIXERS
from lm.ops.call import OpCall
from lm.util.errors import UserError

# Rows besides a mixer's default: a label -> the options that differ (none for a mixer not listed). Mesa: fewer CG
# steps than its 30, and 30 that stop at a tolerance.
VARIANTS = {"mesa": {"cg 0": {"cg_steps": 0}, "cg 5": {"cg_steps": 5}, "cg 10": {"cg_steps": 10},
                     "tol 1e-4": {"cg_tol": 1e-4}}}
# A mixer whose chunkwise time a mixer's rows are divided by (none for a mixer not listed). Mesa: Gated DeltaNet, the
# fastest exact-memory rule, the cost Mesa's solve adds is against it.
REFERENCE = {"mesa": "gated_deltanet"}


class Form:
    """One form of an op called with the mixer's keywords; keeps the info dict of its last call, for ops that
    return one (Mesa's CG iterations and residuals)."""

    def __init__(self, fn, kwargs: dict):
        self.fn, self.kwargs, self.info = fn, kwargs, None

    def __call__(self, *args):
        out, state, *info = self.fn(*args, **self.kwargs)
        self.info = info[0] if info else None
        return out, state


def bench_mixer_names() -> list[str]:
    """The mixers with a recurrent op (those built on an op of lm.ops)."""
    return [name for name, cls in MIXERS.items() if cls.recurrent()]


@torch.no_grad()
def op_call(mixer: str, T: int, d_model: int, n_heads: int, head_dim: int, batch: int,
            **options) -> tuple[OpCall, torch.Tensor]:
    """The op a mixer (built with `options`) calls, its inputs as leaves that need grad, and a fixed random projection
    of its output."""
    torch.manual_seed(0)
    call = MIXERS[mixer](d_model, n_heads, head_dim, **options).bench_op(batch, T)
    if call is None:
        raise UserError(f"{mixer} has no chunkwise/recurrent op to benchmark")
    call.args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in call.args]
    out = call.forms.chunkwise(*call.args, **call.options)[0]
    return call, torch.randn(out.shape)


def op_inputs(mixer: str, T: int, d_model: int, n_heads: int, head_dim: int, batch: int) -> tuple:
    """(op name, positional inputs, output projection) of a mixer with default options; the op is
    lm.ops.call.FORMS[name]."""
    call, proj = op_call(mixer, T, d_model, n_heads, head_dim, batch)
    return call.op, call.args, proj


def op_fns(call: OpCall) -> tuple[Form, Form]:
    return Form(call.forms.chunkwise, call.options), Form(call.forms.recurrent, call.recurrent_options())


def forward_backward(fn, args: list, proj: torch.Tensor) -> torch.Tensor:
    """fn(*args)[0] (detached; fn returns (output, ...) as lm's ops do) after the backward pass of a random
    projection of it into the .grad of args: every output element sends back a different gradient."""
    for a in args:
        if isinstance(a, torch.Tensor):
            a.grad = None
    out = fn(*args)[0]
    (out * proj).sum().backward()
    return out.detach()


def best_ms(fn, args: list, proj: torch.Tensor, repeats: int, max_s: float = math.inf) -> float:
    """Best wall time of forward + backward in ms, after one untimed warm-up call, over `repeats` timed calls, or
    fewer (at least one) once the timed calls add up to max_s seconds. A warm-up call that alone takes max_s or more
    is the figure itself (one call): one-time costs are lost in a call that long, and repeating it is not."""
    t0 = time.perf_counter()
    forward_backward(fn, args, proj)
    best = time.perf_counter() - t0
    if best >= max_s:
        return 1e3 * best
    best, total = math.inf, 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward_backward(fn, args, proj)
        elapsed = time.perf_counter() - t0
        best, total = min(best, elapsed), total + elapsed
        if total >= max_s:
            break
    return 1e3 * best


def peak_mib(mixer: str, T: int, d_model: int, n_heads: int, head_dim: int, batch: int,
             options: dict | None = None) -> float:
    """Peak tensor memory of one chunkwise forward + backward above what its inputs hold, MiB (torch's allocations,
    lm.bench.memory.allocated_peak_mib)."""
    call, proj = op_call(mixer, T, d_model, n_heads, head_dim, batch, **(options or {}))
    chunkwise = op_fns(call)[0]
    return allocated_peak_mib(lambda: forward_backward(chunkwise, call.args, proj))


def bench_mixers(mixers: list[str] | None = None, lengths: list[int] = [512, 2048, 8192],  # noqa: B006
                 d_model: int = 256, n_heads: int = 4, head_dim: int = 64, batch: int = 1,
                 recurrent_max_len: int = 2048, memory: bool = True, repeats: int = 3, max_s: float = 5.0,
                 variants: bool = True, options: dict | None = None, json_out: str | None = None) -> dict:
    """Time forward + backward of each mixer's op, chunkwise and recurrent, and the chunkwise form's peak memory.

    Args:
        mixers: Mixers whose op to run (names in lm.mixers.MIXERS with a recurrent op; default: all of them).
        lengths: Sequence lengths T.
        d_model: Model width the mixers' head shapes derive from.
        n_heads: Heads of each mixer.
        head_dim: head_dim of the mixers (key or state size; some mixers ignore it).
        batch: Sequences per call.
        recurrent_max_len: Time the recurrent form only up to this T (its step loop is slow); null beyond.
        memory: Also measure the chunkwise form's peak memory (tracked allocations); default rows only.
        repeats: Timed calls per figure after one warm-up; the best counts.
        max_s: Stop a figure's timed calls early (after at least one) once they add up to this many seconds; a
            warm-up call that alone takes this long is the figure (one call).
        variants: Also the rows of each mixer's VARIANTS ("mesa (cg 5)"), chunkwise only.
        options: Mixer options for every row ({expand_v: 1.0}: DeltaNet and Gated DeltaNet at equal value size);
            each mixer named must take them.
        json_out: Also write the result as JSON to this path.

    Each row of a mixer with a REFERENCE also gets vs_reference: its chunkwise time over the reference
    mixer's at the same T (null when the reference is not among mixers). Rows of ops that report info (Mesa) give
    its mean CG iterations.
    """
    known = bench_mixer_names()
    mixers = known if mixers is None else mixers
    unknown = [m for m in mixers if m not in known]
    if unknown or repeats < 1 or batch < 1 or min(lengths, default=0) < 1:
        raise UserError(f"mixers must be among {', '.join(known)} (unknown: {unknown}); repeats, batch and lengths "
                        f"(at least one) must be >= 1")
    shape = dict(d_model=d_model, n_heads=n_heads, head_dim=head_dim, batch=batch)
    runs = []  # (mixer, row label, options, default row)
    for mixer in mixers:
        runs.append((mixer, mixer, dict(options or {}), True))
        for label, variant in (VARIANTS.get(mixer, {}).items() if variants else ()):
            runs.append((mixer, f"{mixer} ({label})", {**(options or {}), **variant}, False))
    rows, row_mixers, measured = [], [], []  # measured: (row, mixer) of the rows whose peak memory to measure
    for mixer, label, row_options, default in each_run(runs, "lm bench mixer", lambda run: run[1]):
        for T in lengths:
            call, proj = op_call(mixer, T, **shape, **row_options)
            chunkwise, recurrent = op_fns(call)
            chunk_ms = best_ms(chunkwise, call.args, proj, repeats, max_s)
            timed = default and T <= recurrent_max_len
            recurrent_ms = best_ms(recurrent, call.args, proj, repeats, max_s) if timed else None
            info = chunkwise.info
            row = {"mixer": label, "op": call.op, "T": T, "chunk_ms": chunk_ms, "recurrent_ms": recurrent_ms,
                   "ratio": None if recurrent_ms is None else recurrent_ms / chunk_ms,
                   "peak_mib": None, "mib_per_1k_tokens": None,
                   "cg_iterations": float(info["iterations"]) if info else None, "reference": None,
                   "vs_reference": None}
            rows.append(row)
            row_mixers.append(mixer)
            if default:
                measured.append((row, mixer))
    chunk_ms = {(r["mixer"], r["T"]): r["chunk_ms"] for r in rows}
    for r, mixer in zip(rows, row_mixers):
        reference = REFERENCE.get(mixer)
        if (reference, r["T"]) in chunk_ms:
            r["reference"], r["vs_reference"] = reference, r["chunk_ms"] / chunk_ms[reference, r["T"]]
    if memory:
        for r, mixer in measured:
            r["peak_mib"] = peak_mib(mixer, r["T"], **shape, options=options)
            r["mib_per_1k_tokens"] = r["peak_mib"] / (batch * r["T"] / 1000)
    result = {"device": device_name(torch.device("cpu")), "torch": torch.__version__,
              "threads": torch.get_num_threads(), **shape, "repeats": repeats, "max_s": max_s,
              "recurrent_max_len": recurrent_max_len, "options": options or {}, "rows": rows}

    print_and_save(result, json_out)
    fmt = lambda x, spec: "–" if x is None else format(x, spec)
    print("\n| mixer | op | T | chunkwise ms | recurrent ms | recurrent / chunkwise | peak MiB | MiB / 1k tokens "
          "| CG iterations | chunkwise / reference |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        vs = "–" if r["vs_reference"] is None else f"{r['vs_reference']:.2f} ({r['reference']})"
        print(f"| {r['mixer']} | {r['op']} | {r['T']} | {r['chunk_ms']:.1f} | {fmt(r['recurrent_ms'], '.1f')} "
              f"| {fmt(r['ratio'], '.1f')} | {fmt(r['peak_mib'], '.1f')} | {fmt(r['mib_per_1k_tokens'], '.2f')} "
              f"| {fmt(r['cg_iterations'], '.2f')} | {vs} |")
    print("\nRows with options in parentheses (variants): chunkwise only; recurrent form and peak memory for the "
          "default rows.")
    return result

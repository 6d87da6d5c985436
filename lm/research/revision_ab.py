"""`lm research ab`: an op of the working tree against the same op at an earlier git revision, in one process, the two
taking turns (lm/bench/timing.py), so that a change to a fast path is measured as a ratio that a noisy machine does not
skew. The inputs and the loss are `lm bench mixer`'s (forward + backward of a fixed random projection)."""

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from lm.bench.mixer_speed import Form, bench_mixer_names, forward_backward, op_call
from lm.bench.timing import best_interleaved
from lm.util.errors import UserError

ROOT = Path(__file__).resolve().parent  # inside the checkout: git finds its repository from here


def op_at_revision(op: str, rev: str):
    """The chunkwise function `op` as lm/ops/OP.py defines it at git revision `rev` (it imports the rest of lm from the
    working tree)."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:lm/ops/{op}.py"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        raise UserError(f"cannot read lm/ops/{op}.py at revision {rev!r} (git show failed: "
                        f"{getattr(err, 'stderr', err)!s}".strip() + ")") from None
    name = f"lm.ops._{op}_at_{rev.replace('~', '_').replace('^', '_')}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(source, f"{rev}:lm/ops/{op}.py", "exec"), module.__dict__)
    return getattr(module, op)


def revision_ab(rev: str, mixers: list[str] | None = None, lengths: list[int] = [512, 2048],  # noqa: B006
             d_model: int = 256, n_heads: int = 4, head_dim: int = 64, batch: int = 1, repeats: int = 4) -> list[dict]:
    """Forward + backward time of each mixer's op at revision REV over the working tree's, as old / new.

    Args:
        rev: The git revision to compare with (a commit, tag or HEAD~1).
        mixers: Mixers whose op is timed, with their default options (as in `lm bench mixer`; default: all).
        lengths: Sequence lengths T.
        d_model: Model width the head shapes come from.
        n_heads: Heads.
        head_dim: Key size per head.
        batch: Batch size.
        repeats: Rounds; each side's best round counts.
    """
    if repeats < 1 or batch < 1 or any(T < 1 for T in lengths):
        raise UserError("--repeats, --batch and --lengths must be positive")
    known = bench_mixer_names()
    mixers = known if mixers is None else mixers
    unknown = [m for m in mixers if m not in known]
    if unknown:
        raise UserError(f"--mixers: {', '.join(unknown)} has no op to compare; one of {', '.join(known)}")
    rows = []
    for mixer in mixers:
        for T in lengths:
            call, proj = op_call(mixer, T, d_model, n_heads, head_dim, batch)
            op, args = call.op, call.args
            old, new = Form(op_at_revision(op, rev), call.options), Form(call.forms.chunkwise, call.options)
            outputs = {side: forward_backward(fn, args, proj) for side, fn in (("old", old), ("new", new))}
            calls = {side: functools.partial(forward_backward, fn, args, proj) for side, fn in (("old", old),
                                                                                                  ("new", new))}
            best = best_interleaved(calls, repeats, torch.device("cpu"))
            rows.append({"mixer": mixer, "op": op, "T": T, "old_ms": 1e3 * best["old"], "new_ms": 1e3 * best["new"],
                         "old_over_new": best["old"] / best["new"],
                         "max_abs_diff": float((outputs["old"] - outputs["new"]).abs().max())})
    print(f"| mixer | op | T | {rev} ms | working tree ms | old / new | max abs diff of outputs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mixer']} | {r['op']} | {r['T']} | {r['old_ms']:.1f} | {r['new_ms']:.1f} | "
              f"{r['old_over_new']:.3f} | {r['max_abs_diff']:.1e} |")
    return rows

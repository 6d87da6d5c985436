"""lm's Mesa op against flash-linear-attention's `chunk_mesa_net`, the one peer with a Mesa kernel: forward + backward
time at equal CG steps, and each one's error against the float64 solve of the same inputs.

Both get the same inputs in the paper's setting (L2-normalised q and k, beta = sigmoid, gamma = sigmoid(. + 3), lam =
0.25 + softplus), with V == K as fla needs, no resets and no tolerance (fla has neither), and run the same number of CG
steps. lm's op takes its "auto" backend by default: the Triton kernels on CUDA, the torch code elsewhere. fla runs only
on CUDA and only for bf16/fp16 inputs; without CUDA its row says so and lm's error is still measured. Both are timed on
the bf16 inputs of training. fla returns bf16, and its error includes that rounding; lm's error is measured on the same
values in float32 (bf16 -> float32 is exact), with a float32 output, so that it is the solve's: in training both outputs
are rounded to bf16 alike.

The float64 solve is lm's torch code in float64 with 2K CG steps, whose own true residual is reported beside it
(CG solves a K x K system in K steps in exact arithmetic; tests/test_op_mesa.py checks that against
torch.linalg.solve): materialising [B, T, H, K, K] for torch.linalg.solve would need 3 GB at T 2048 and K 128.
"""

from functools import partial

import torch
import torch.nn.functional as F

from lm.bench.mixer_speed import forward_backward
from lm.bench.timing import best_interleaved
from lm.ops.fla_mesa import fla_mesa_available
from lm.ops.mesa import mesa

NAMES = ("q", "k", "v", "log_gamma", "beta", "lam")


def mesa_inputs(T: int, n_heads: int, head_dim: int, batch: int, device: torch.device, seed: int = 0) -> dict:
    """The paper's setting; q, k, v in bf16 on CUDA (fla's dtype), float32 elsewhere; gates and lam in float32."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g)
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = dict(
        q=F.normalize(rand(batch, T, n_heads, head_dim), dim=-1).to(half),
        k=F.normalize(rand(batch, T, n_heads, head_dim), dim=-1).to(half),
        v=rand(batch, T, n_heads, head_dim).to(half),
        log_gamma=F.logsigmoid(rand(batch, T, n_heads) + 3),
        beta=torch.sigmoid(rand(batch, T, n_heads)),
        lam=0.25 + F.softplus(rand(n_heads, head_dim)),
    )
    return {name: t.to(device) for name, t in x.items()}


def exact_solve(x: dict) -> tuple[torch.Tensor, float]:
    """(The float64 output of the inputs as given, the largest true relative residual of its solve)."""
    x64 = [x[name].double() for name in NAMES]
    out, _, info = mesa(*x64, cg_steps=2 * x["q"].shape[-1], backend="torch", return_info=True)
    return out, info["residual_max"].item()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def bench_mesa(lengths: list[int], n_heads: int, head_dim: int, batch: int, cg_steps: int, repeats: int,
               device: torch.device, backend: str = "auto") -> dict:
    """Forward + backward ms of lm's mesa (`backend`) and fla's chunk_mesa_net at each length, and their output errors
    against the float64 solve."""
    run_fla = device.type == "cuda" and fla_mesa_available()
    rows = []
    for T in lengths:
        x = mesa_inputs(T, n_heads, head_dim, batch, device)
        exact, exact_residual = exact_solve(x)
        proj = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(1)).to(device, x["v"].dtype)
        args = {backend: [x[name].detach().clone().requires_grad_() for name in NAMES] for backend in ("lm", "fla")}
        calls = {"lm": partial(forward_backward, partial(mesa, cg_steps=cg_steps, backend=backend), args["lm"], proj)}
        if run_fla:
            calls["fla"] = partial(forward_backward, partial(mesa, cg_steps=cg_steps, backend="fla"), args["fla"],
                                   proj)
        errors = {side: relative_error(call(), exact) for side, call in calls.items()}  # also the warm-ups
        if x["q"].dtype != torch.float32:
            as_float = [t.detach().float() for t in args["lm"]]
            errors["lm"] = relative_error(mesa(*as_float, cg_steps=cg_steps, backend=backend)[0], exact)
        seconds = best_interleaved(calls, repeats, device)
        row = {"T": T, "lm_ms": 1e3 * seconds["lm"], "lm_error": errors["lm"], "exact_residual_max": exact_residual}
        if run_fla:
            row.update(fla_ms=1e3 * seconds["fla"], fla_error=errors["fla"], lm_vs_fla=seconds["fla"] / seconds["lm"],
                       error_ratio=errors["lm"] / errors["fla"])
        rows.append(row)
    return {"backend": backend, "n_heads": n_heads, "K": head_dim, "V": head_dim, "batch": batch, "cg_steps": cg_steps,
            "dtype": str(x["q"].dtype).removeprefix("torch."), "repeats": repeats,
            "fla": "chunk_mesa_net" if run_fla else "not run: it needs CUDA and fla.ops.mesa_net", "rows": rows}


def print_mesa_table(m: dict) -> None:
    print(f"\nMesa forward + backward (lm's backend {m['backend']}, {m['dtype']} inputs, H {m['n_heads']}, "
          f"K = V = {m['K']}, batch {m['batch']}, {m['cg_steps']} CG steps; fla: {m['fla']})\n")
    print("| T | lm ms | fla ms | lm speed / fla | lm error | fla error | lm error / fla error | float64 residual |")
    print("|---|---|---|---|---|---|---|---|")
    for r in m["rows"]:
        fla = (f"{r['fla_ms']:.1f} | {r['lm_vs_fla']:.2f}" if "fla_ms" in r else "- | -")
        errors = (f"{r['fla_error']:.1e} | {r['error_ratio']:.3f}" if "fla_error" in r else "- | -")
        print(f"| {r['T']} | {r['lm_ms']:.1f} | {fla} | {r['lm_error']:.1e} | {errors} "
              f"| {r['exact_residual_max']:.0e} |")

"""Speed and memory of the sequence ops behind the recurrent mixers: chunkwise form (training) vs recurrent form.

Each mixer's op gets the head shapes its module builds for (d_model, n_heads, head_dim) with default options, and
random inputs in the ranges the module feeds it. Timings are forward + backward. Peak memory is the growth of peak
RSS during one chunkwise forward + backward, each (mixer, T) in a fresh process (CPU, Linux).

Mesa gets one row per CG step count (and one with early stopping at a tolerance), each compared with gated_deltanet
at the same (d_model, n_heads, head_dim); its recurrent form (a CG solve per step, by far the slowest loop) is timed
only at the mixer's default step count and up to mesa_recurrent_max_len.
"""

import inspect
import json
import math
import time

import torch
import torch.nn.functional as F

from bench.memory import fresh_processes, peak_growth_mib
from bench.train_speed import device_name
from lm.errors import UserError
from lm.mixers import MIXERS, MLSTM, DeltaNet, Mamba2, Mesa
from lm.mixers.mlstm import soft_cap
from lm.ops import (
    delta_rule,
    delta_rule_recurrent,
    linear_attention,
    linear_attention_recurrent,
    mesa,
    mesa_recurrent,
    mlstm,
    mlstm_recurrent,
)

OPS = {  # op name: (chunkwise, recurrent)
    "linear_attention": (linear_attention, linear_attention_recurrent),
    "delta_rule": (delta_rule, delta_rule_recurrent),
    "mlstm": (mlstm, mlstm_recurrent),
    "mesa": (mesa, mesa_recurrent),
}
MESA_CG_STEPS = inspect.signature(Mesa).parameters["cg_steps"].default  # the mixer's default (30)
# mesa_recurrent runs up to 30 CG steps per token in a Python loop, much the slowest recurrent form: one forward +
# backward (d_model 256, 4 heads, head_dim 64) took 7.4 s at T = 512 and 34 s at T = 2048 on the quiet 2-core CPU
# of docs/performance.md (several times that while other processes ran). The default run affords that (one call there,
# see best_ms); longer T only with a larger mesa_recurrent_max_len.
MESA_RECURRENT_MAX_LEN = 2048


class MesaCall:
    """mesa or mesa_recurrent with fixed CG settings, called like the other ops; keeps the info dict (mean CG
    iterations, residuals) of its last call. The info costs one more matvec per solve (the true residual); the Mesa
    mixer always asks for it, so the timings include it as training does."""

    def __init__(self, fn, cg_steps: int, cg_tol: float | None):
        self.fn, self.cg_steps, self.cg_tol, self.info = fn, cg_steps, cg_tol, None

    def __call__(self, *args):
        out, state, self.info = self.fn(*args, cg_steps=self.cg_steps, cg_tol=self.cg_tol, return_info=True)
        return out, state


def op_fns(op: str, cg_steps: int = MESA_CG_STEPS, cg_tol: float | None = None) -> tuple:
    """(chunkwise, recurrent) callables of an op; the CG settings apply to mesa only."""
    chunkwise, recurrent = OPS[op]
    if op == "mesa":
        return MesaCall(chunkwise, cg_steps, cg_tol), MesaCall(recurrent, cg_steps, cg_tol)
    return chunkwise, recurrent


def tol_label(tol: float) -> str:
    """1e-4 for 0.0001, 2.5e-3 for 0.0025."""
    mantissa, exponent = f"{tol:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


@torch.no_grad()
def op_inputs(mixer: str, T: int, d_model: int, n_heads: int, head_dim: int, batch: int) -> tuple:
    """The op a mixer calls and its positional inputs, as leaves that need grad, plus a fixed output projection.

    Shapes and decay parameters come from the mixer module itself (built with default options), so they cannot
    drift from what a model layer feeds the op.
    """
    torch.manual_seed(0)
    m = MIXERS[mixer](d_model, n_heads, head_dim)
    randn = lambda *dims: torch.randn(batch, T, n_heads, *dims)  # [B, T, H, *]
    if isinstance(m, Mamba2):
        K, V = m.state_size, m.inner // n_heads
        dt = F.softplus(randn() + m.dt_bias)  # about 1e-3..0.3
        op, args = "linear_attention", [randn(K), randn(K), randn(V), -torch.exp(m.A_log) * dt, dt, 1.0]
    elif isinstance(m, DeltaNet):
        K, V = m.key_dim, m.value_dim
        q, k = F.normalize(randn(K), dim=-1), F.normalize(randn(K), dim=-1)  # the mixer L2-normalises both
        log_alpha = -torch.exp(m.A_log) * F.softplus(randn() + m.dt_bias) if m.gated else None
        op, args = "delta_rule", [q, k, randn(V), torch.sigmoid(randn()), log_alpha, K**-0.5]
    elif isinstance(m, MLSTM):
        K, V = m.qk_head, m.v_head
        i_pre = soft_cap(torch.empty(batch, T, n_heads).uniform_(-10, 0), m.gate_soft_cap)
        f_pre = soft_cap(m.fgate.bias + randn(), m.gate_soft_cap)  # bias 3..6 across heads: forget gates open
        op, args = "mlstm", [randn(K), randn(K), randn(V), i_pre, f_pre]
    elif isinstance(m, Mesa):
        K, V = m.key_dim, m.value_dim
        q, k = F.normalize(randn(K), dim=-1), F.normalize(randn(K), dim=-1)  # the mixer L2-normalises both
        beta = torch.sigmoid(randn() + m.beta_proj.bias)  # bias 0
        log_gamma = F.logsigmoid(randn() + m.gamma_proj.bias)  # the gate biases of its gamma_init
        if m.gamma_cap is not None:
            log_gamma = log_gamma + torch.log1p(-(1 - m.gamma_cap) * beta**2)
        op, args = "mesa", [q, k, randn(V), log_gamma, beta, m.lam().clone()]  # lam [H, K], 1 at init
    else:
        raise ValueError(f"{mixer!r} has no chunkwise/recurrent op to benchmark")
    args = [a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    return op, args, torch.randn(batch, T, n_heads, V)


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
             cg_steps: int = MESA_CG_STEPS, cg_tol: float | None = None) -> float:
    """Run in a fresh process: peak RSS of one chunkwise forward + backward minus the RSS after inputs exist, MiB.

    RSS accounting is approximate: figures within a few tenths of a MiB of 0 (even negative) are noise."""
    # A short run first, so one-time costs (autograd threads, library buffers) do not count as memory that grows in T.
    op, args, proj = op_inputs(mixer, 64, d_model, n_heads, head_dim, batch)
    chunkwise = op_fns(op, cg_steps, cg_tol)[0]
    forward_backward(chunkwise, args, proj)
    op, args, proj = op_inputs(mixer, T, d_model, n_heads, head_dim, batch)
    return peak_growth_mib(lambda: forward_backward(chunkwise, args, proj))


def bench_mixers(mixers: list[str] = ["mamba2", "mlstm", "deltanet", "gated_deltanet", "mesa"],  # noqa: B006
                 lengths: list[int] = [512, 2048, 8192], d_model: int = 256, n_heads: int = 4,  # noqa: B006
                 head_dim: int = 64, batch: int = 1, recurrent_max_len: int = 2048, memory: bool = True,
                 repeats: int = 3, max_s: float = 5.0, mesa_cg_steps: list[int] = [0, 5, 10, 30],  # noqa: B006
                 mesa_cg_tol: float | None = 1e-4, mesa_recurrent_max_len: int = MESA_RECURRENT_MAX_LEN,
                 json_out: str | None = None) -> dict:
    """Time forward + backward of each mixer's op, chunkwise and recurrent, and the chunkwise form's peak memory.

    Args:
        mixers: Mixers whose op to run (names in lm.mixers.MIXERS, attention excluded).
        lengths: Sequence lengths T.
        d_model: Model width the mixers' head shapes derive from.
        n_heads: Heads of each mixer.
        head_dim: head_dim option of the mixers (key or state size; mLSTM ignores it).
        batch: Sequences per call.
        recurrent_max_len: Time the recurrent form only up to this T (its step loop is slow); null beyond.
        memory: Also measure the chunkwise form's peak memory, one fresh process per (mixer, T); for mesa only the
            row with the mixer's default CG steps (30) and no tolerance.
        repeats: Timed calls per figure after one warm-up; the best counts.
        max_s: Stop a figure's timed calls early (after at least one) once they add up to this many seconds; a
            warm-up call that alone takes this long is the figure (one call).
        mesa_cg_steps: CG step counts of the mesa rows, one row ("mesa (cg N)") per count and T.
        mesa_cg_tol: Also a row "mesa (tol X)" with 30 CG steps that stop early at this relative residual; None:
            no such row. Every mesa row reports the mean CG iterations of its forward solve.
        mesa_recurrent_max_len: Time mesa's recurrent form (a CG solve per step, by far the slowest loop) only up
            to this T, and only for the row with 30 steps and no tolerance.
        json_out: Also write the result as JSON to this path.

    Mesa rows also get vs_gated_deltanet: their chunkwise time over gated_deltanet's at the same T (null when
    gated_deltanet is not among mixers).
    """
    unknown = [m for m in mixers if not issubclass(MIXERS.get(m, object), (Mamba2, DeltaNet, MLSTM, Mesa))]
    if (unknown or repeats < 1 or batch < 1 or min(lengths, default=0) < 1
            or any(not isinstance(s, int) or s < 0 for s in mesa_cg_steps)
            or not (mesa_cg_tol is None or mesa_cg_tol > 0)):
        raise UserError(f"mixers must be among mamba2, mlstm, deltanet, gated_deltanet, mesa (unknown: {unknown}); "
                        f"repeats, batch and lengths (at least one) must be >= 1, mesa_cg_steps >= 0 and "
                        f"mesa_cg_tol positive or None")
    shape = dict(d_model=d_model, n_heads=n_heads, head_dim=head_dim, batch=batch)
    mesa_max_len = min(recurrent_max_len, mesa_recurrent_max_len)
    runs = []  # (mixer, row label, CG steps, CG tolerance); the CG settings only matter for mesa
    for mixer in mixers:
        if mixer != "mesa":
            runs.append((mixer, mixer, MESA_CG_STEPS, None))
            continue
        runs += [(mixer, f"mesa (cg {steps})", steps, None) for steps in mesa_cg_steps]
        if mesa_cg_tol is not None:
            runs.append((mixer, f"mesa (tol {tol_label(mesa_cg_tol)})", MESA_CG_STEPS, mesa_cg_tol))
    rows, measured = [], []  # measured: (row, mixer, CG settings) of the rows whose peak memory to measure
    for mixer, label, cg_steps, cg_tol in runs:
        # mesa's recurrent form and peak memory only at the mixer's own setting (its default steps, no tolerance).
        default_mesa = cg_steps == MESA_CG_STEPS and cg_tol is None
        max_len = recurrent_max_len if mixer != "mesa" else mesa_max_len if default_mesa else 0
        for T in lengths:
            op, args, proj = op_inputs(mixer, T, **shape)
            chunkwise, recurrent = op_fns(op, cg_steps, cg_tol)
            chunk_ms = best_ms(chunkwise, args, proj, repeats, max_s)
            recurrent_ms = best_ms(recurrent, args, proj, repeats, max_s) if T <= max_len else None
            row = {"mixer": label, "op": op, "T": T, "chunk_ms": chunk_ms, "recurrent_ms": recurrent_ms,
                   "ratio": None if recurrent_ms is None else recurrent_ms / chunk_ms,
                   "peak_mib": None, "mib_per_1k_tokens": None,
                   "cg_iterations": float(chunkwise.info["iterations"]) if op == "mesa" else None,
                   "vs_gated_deltanet": None}
            rows.append(row)
            if mixer != "mesa" or default_mesa:
                measured.append((row, mixer, cg_steps, cg_tol))
    gated = {r["T"]: r["chunk_ms"] for r in rows if r["mixer"] == "gated_deltanet"}
    for r in rows:
        if r["op"] == "mesa" and r["T"] in gated:
            r["vs_gated_deltanet"] = r["chunk_ms"] / gated[r["T"]]
    if memory:
        with fresh_processes() as pool:
            for r, mixer, cg_steps, cg_tol in measured:
                r["peak_mib"] = pool.apply(peak_mib, (mixer, r["T"]), dict(shape, cg_steps=cg_steps, cg_tol=cg_tol))
                r["mib_per_1k_tokens"] = r["peak_mib"] / (batch * r["T"] / 1000)
    result = {"device": device_name(torch.device("cpu")), "torch": torch.__version__,
              "threads": torch.get_num_threads(), **shape, "repeats": repeats, "max_s": max_s,
              "recurrent_max_len": recurrent_max_len, "mesa_recurrent_max_len": mesa_max_len, "rows": rows}

    print(json.dumps(result, indent=2))
    fmt = lambda x, spec: "–" if x is None else format(x, spec)
    print("\n| mixer | op | T | chunkwise ms | recurrent ms | recurrent / chunkwise | peak MiB | MiB / 1k tokens "
          "| CG iterations | chunkwise / gated_deltanet |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mixer']} | {r['op']} | {r['T']} | {r['chunk_ms']:.1f} | {fmt(r['recurrent_ms'], '.1f')} "
              f"| {fmt(r['ratio'], '.1f')} | {fmt(r['peak_mib'], '.1f')} | {fmt(r['mib_per_1k_tokens'], '.2f')} "
              f"| {fmt(r['cg_iterations'], '.2f')} | {fmt(r['vs_gated_deltanet'], '.2f')} |")
    if "mesa" in mixers:
        print(f"\nmesa: recurrent form timed only with cg {MESA_CG_STEPS} (no tolerance) and only at T <= "
              f"{mesa_max_len} (mesa_recurrent_max_len {mesa_recurrent_max_len}, recurrent_max_len "
              f"{recurrent_max_len}); peak memory only with cg {MESA_CG_STEPS}.")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=2)
    return result

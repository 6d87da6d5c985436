"""The Mesa layer of MesaNet (von Oswald et al., arXiv 2506.05233): at every step, the output of the linear
least-squares model that best maps the keys seen so far to their values,

    G_t = gamma_t G_{t-1} + beta_t v_t k_t^T        [V, K]
    H_t = gamma_t H_{t-1} + beta_t k_t k_t^T        [K, K]
    o_t = G_t (H_t + diag(lam))^{-1} q_t            gamma_t = exp(log_gamma_t), lam: [H, K] positive

`mesa` is the chunkwise form for training. The states are never materialised per token: the linear system
A_t x_t = q_t (A_t = H_t + diag(lam), symmetric positive definite) is solved by conjugate gradients (CG) for all
tokens and heads at once, and every matvec H_t p_t (all t together) is a chunkwise gated-linear-attention product with
the keys as values, i.e. `linear_attention(p, k, k, log_gamma, beta, initial_state=H_0^T)`. Its per-chunk pieces (decay
matrices, the state entering each chunk) do not depend on p, so `_ChunkedKeyState` computes them once per solve and
each CG step is then three batched matmuls. The readout G_t x_t is `linear_attention(x, k, v, ...)`.

CG is warm-started at the Jacobi guess x_0 = q / diag(A_t) (diag(H_t) is a decayed cumulative sum of beta k^2),
runs at most `cg_steps` steps and, with `cg_tol`, freezes each (token, head) once ||r|| <= cg_tol ||r_0||, stopping
when all have converged. In exact arithmetic CG solves a K x K system in K steps, so cg_steps >= K gives the exact
layer. `cg_steps=0` skips the solve and returns G_t q_t: exactly gated linear attention with query q (the paper's
reduction of the Mesa layer to linear attention), computed by `linear_attention`, with no warm start.

Backward (implicit differentiation, the forward CG is never unrolled). With x_t = A_t^{-1} q_t and o_t = G_t x_t,
a perturbation gives dx_t = A_t^{-1}(dq_t - dA_t x_t), so for a loss with do_t = dL/do_t
    dL = sum_t do_t . (dG_t x_t) + (G_t^T do_t) . A_t^{-1}(dq_t - dH_t x_t - dlam * x_t)
and, A_t being symmetric, the adjoint e_t = A_t^{-1} G_t^T do_t (one more CG solve, same warm start and stopping
rule) gives dL/dq_t = e_t and, for everything else (k, v, log_gamma, beta, lam, G_0, H_0), the gradient of the
scalar surrogate
    S = sum_t [do_t . (G_t xb_t) - eb_t . (H_t xb_t) - eb_t . (lam * xb_t)] + <dG_T, G_T> + <dH_T, H_T>
with xb = x and eb = e held constant. G_t xb_t and H_t xb_t are linear_attention calls (their final states are G_T,
H_T), so autograd through them gives those gradients; `_MesaFunction.backward` does exactly that. With a truncated
solve (cg_steps < K, or cg_tol) this is the exact-solve gradient evaluated at the approximate x and e, not the
derivative of the truncated iteration. `mesa_recurrent`, for decoding, differentiates its solve the same way
(`_ImplicitSolve`): backpropagating through converged float32 CG steps divides by residuals near zero and gives NaN.

Both forms solve in float32 (float64 for float64 inputs) whatever the input dtype, and with autocast off (under
bf16-mixed it would recast every matvec to bf16), forward, adjoint and decoding alike. They return the output in the
input dtype and the state (G [B, H, V, K], H [B, H, K, K]) in the compute dtype. H_0 should be symmetric positive
semi-definite (a state this op returned is).

`reset` [B, T] bool clears both states before the marked steps (G_{t-1} = H_{t-1} := 0: a document starts). G and H
are linear-attention states, so every piece above (the matvecs, the readout, the surrogate) takes it as
`linear_attention` does.
"""

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lm.ops import self_check
from lm.ops.common import (
    ChunkDocuments,
    autocast_off,
    causal_decay,
    check_shapes,
    compute_dtype,
    effective_chunk_size,
    from_head_chunks,
    keep_state,
    to_head_chunks,
    warn_once,
)
from lm.ops.fla_mesa import fla_mesa, fla_mesa_check
from lm.ops.kernel_packages import import_kernels
from lm.ops.linear_attention import linear_attention

BACKENDS = ("auto", "torch", "triton", "fla")

MesaState = tuple[torch.Tensor, torch.Tensor]  # (G [B, H, V, K], H [B, H, K, K])


@autocast_off()
def mesa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    cg_steps: int = 30,
    cg_tol: float | None = None,
    initial_state: MesaState | None = None,
    reset: torch.Tensor | None = None,
    chunk_size: int = 64,
    return_info: bool = False,
    backend: str = "auto",
):
    """Chunkwise Mesa layer.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_gamma, beta: [B, T, H]; lam: [H, K] (positive); initial_state: (G_0
    [B, H, V, K], H_0 [B, H, K, K]) or None (zeros); reset: [B, T] bool or None (True: both states cleared before
    the step). Any T works. Returns (out [B, T, H, V] in q's dtype, (G_T, H_T)
    in float32, or float64 for float64 inputs), and with return_info=True also an info dict of detached 0-dim
    float32 tensors (no device sync) about the forward solve: "iterations" (mean CG steps per token and head),
    "iterations_run" (the steps the code ran per token, mean over tokens and heads: the torch code's loop runs until
    the call's last token has converged, a Triton program until its chunk's last; what the FLOP count charges),
    "residual" and "residual_max" (mean and max of the true relative residual ||q_t - A_t x_t|| / ||q_t||, measured
    with one more matvec) and "diag_ratio" (max diag(H_t) / min lam, a cheap conditioning indicator: cond(A_t) <=
    (lambda_max(H_t) + max lam) / min lam, and lambda_max(H_t) >= max diag(H_t)). The backward adds the adjoint
    solve's "adjoint_iterations", "adjoint_iterations_run", "adjoint_residual" and "adjoint_residual_max" to the
    same dict. With cg_steps=0: 0 steps, residual 1.
    cg_steps: most CG steps per token (0: plain gated linear attention with query q); cg_tol: relative residual at
    which a token stops early (None: always cg_steps steps). The backward's adjoint solve uses both as well.
    backend: "torch" (this code), "triton" (lm's kernels, lm/ops/mesa_triton.py: the same CG step for step, each
    chunk's iterations in one program; K <= 128 and V <= 256; CUDA, or the CPU under TRITON_INTERPRET=1; their chunk
    is `kernel_chunk(chunk_size, K, V)`), "fla" (flash-linear-attention's chunk_mesa_net: CUDA, bf16/fp16, V == K,
    fixed step count, no info, no resets; see lm/ops/fla_mesa.py) or "auto": triton on CUDA where Triton imports and
    takes the head sizes (saying once when not), else this code. fla's solver is not the same algorithm (other warm
    start, damped step sizes), so it is only used when asked for. With cg_steps=0 the backend is passed on to
    `linear_attention` ("triton" as "auto"). The first use of "triton" or "fla" per device and shape class checks
    the kernels once against this code (lm.ops.self_check); where they disagree, this code runs.
    """
    _check_inputs(q, k, v, log_gamma, beta, lam, initial_state, cg_steps, cg_tol, reset)
    chunk_size = effective_chunk_size(chunk_size, q.shape[1])
    backend = _resolve_backend(backend, q.is_cuda, q.shape[-1], v.shape[-1])
    if cg_steps == 0:
        return _linear_attention_readout(q, k, v, log_gamma, beta, initial_state, reset, chunk_size, return_info,
                                         "auto" if backend == "triton" else backend)
    if backend == "triton" and not _triton_agrees(q, k, v, log_gamma, beta, lam, cg_steps, cg_tol, reset,
                                                  chunk_size):
        backend = "torch"
    if backend == "fla":
        fla_mesa_check(q, k, v, cg_tol=cg_tol, return_info=return_info, reset=reset)
        if _fla_agrees(q, k, v, log_gamma, beta, lam, initial_state, chunk_size):
            return fla_mesa(q, k, v, log_gamma, beta, lam, cg_steps, initial_state)
        backend = "torch"

    G0, H0 = _initial_state(initial_state, q, v.shape[-1], compute_dtype(q))
    info = {} if return_info else None  # the forward fills it; the backward adds the adjoint solve's entries
    solver = _TritonSolver(chunk_size) if backend == "triton" else _TorchSolver(chunk_size)
    solve = _Solve(solver, steps=cg_steps, tol=cg_tol, reset=reset, info=info)
    out, G, H = _apply_eagerly(q, k, v, log_gamma, beta, lam, G0, H0, solve)
    return (out, (G, H), info) if return_info else (out, (G, H))


def _resolve_backend(backend: str, on_cuda: bool, K: int, V: int) -> str:
    """"auto" -> "triton" for CUDA inputs where Triton imports and the kernels take the head sizes, else "torch" (said
    once on CUDA: a several times slower fallback is never silent); an explicit "triton" must be able to run."""
    if backend not in BACKENDS:
        raise ValueError(f"mesa: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if not on_cuda:
            return "torch"
        kernels = _triton_kernels()
        why = "Triton does not import (install lm[gpu])" if kernels is None else kernels.unsupported(K, V)
        if why is not None:
            warn_once(f"mesa: the Mesa layer runs its torch code on CUDA, several times slower than its Triton "
                      f"kernels: {why}.")
            return "torch"
        return "triton"
    if backend == "triton":
        kernels = _triton_kernels()
        if kernels is None:
            raise RuntimeError("mesa: backend='triton' needs Triton; install lm[gpu] (or lm[dev], for the CPU "
                               "interpreter)")
        if kernels.unsupported(K, V):
            raise ValueError(f"mesa: backend='triton': {kernels.unsupported(K, V)}; use backend='torch'")
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("mesa: backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 to run the kernels "
                               "on the CPU")
    return backend


def _triton_agrees(q, k, v, log_gamma, beta, lam, cg_steps, cg_tol, reset, chunk_size) -> bool:
    """The kernels' self-check (lm.ops.self_check): the first call of a shape class on a device runs them once
    against the torch code on a small seeded input (one batch row, two heads, two chunks and an odd tail, a carried
    state, resets where the call has them), in the call's dtypes, with the call's step count and tolerance. A
    backend named "triton" is checked as "auto"'s is: it asks for the same numbers, faster (the CPU tests reach the
    kernels this way, under the interpreter). The shape class is what the kernels are compiled for: the dtypes, the
    head sizes (their blocks and the kernels' chunk follow), resets or not, a tolerance or not."""
    K, V = q.shape[-1], v.shape[-1]
    chunk = _triton_kernels().kernel_chunk(chunk_size, K, V)
    dtypes = tuple(t.dtype for t in (q, k, v, log_gamma, beta, lam))
    shape_class = (dtypes, K, V, chunk, reset is not None, cg_tol is not None)
    T = 2 * chunk + 3

    def make_inputs(g):
        B, H = 1, 2
        M = self_check.normal(g, B, H, K, 2 * K)
        return dict(
            q=self_check.unit(g, B, T, H, K, dtype=q.dtype).requires_grad_(),
            k=self_check.unit(g, B, T, H, K, dtype=k.dtype).requires_grad_(),
            v=self_check.normal(g, B, T, H, V, dtype=v.dtype).requires_grad_(),
            log_gamma=self_check.log_decay(g, B, T, H, dtype=log_gamma.dtype).requires_grad_(),
            beta=torch.sigmoid(self_check.normal(g, B, T, H)).to(beta.dtype).requires_grad_(),
            lam=(0.25 + F.softplus(self_check.normal(g, H, K))).to(lam.dtype).requires_grad_(),
            G0=self_check.normal(g, B, H, V, K, scale=0.1).requires_grad_(),
            H0=(M @ M.mT / K).requires_grad_(),
            reset=None if reset is None else self_check.resets(B, T, q.device),
        )

    def run(backend):
        def call(q, k, v, log_gamma, beta, lam, G0, H0, reset):
            out, (G, Hs) = mesa(q, k, v, log_gamma, beta, lam, cg_steps=cg_steps, cg_tol=cg_tol, initial_state=(G0, H0),
                                reset=reset, chunk_size=chunk_size, backend=backend)
            return dict(out=out, G=G, H=Hs)

        return call

    return self_check.checked("mesa_triton", q.device, shape_class, run("triton"), run("torch"), make_inputs, q.dtype)


def _fla_agrees(q, k, v, log_gamma, beta, lam, initial_state, chunk_size) -> bool:
    """The self-check of fla's chunk_mesa_net (named only: "auto" never takes it), as tests/test_ops_gpu_mesa.py's
    test_fla_matches_torch, smaller: its CG is not ours, so both run the 30 steps of that test, where both have
    converged, whatever the call's step count. The shape class: the dtypes, K (= V), an initial state or not."""
    K = q.shape[-1]
    dtypes = tuple(t.dtype for t in (q, k, v, log_gamma, beta, lam))
    shape_class = (dtypes, K, initial_state is not None)

    def make_inputs(g):
        B, T, H = 1, 2 * 64 + 3, 2  # two of fla's chunks of 64 and an odd tail
        M = self_check.normal(g, B, H, K, K)
        x = dict(
            q=self_check.unit(g, B, T, H, K, dtype=q.dtype).requires_grad_(),
            k=self_check.unit(g, B, T, H, K, dtype=k.dtype).requires_grad_(),
            v=self_check.normal(g, B, T, H, K, dtype=v.dtype).requires_grad_(),
            log_gamma=self_check.log_decay(g, B, T, H, dtype=log_gamma.dtype).requires_grad_(),
            beta=torch.sigmoid(self_check.normal(g, B, T, H)).to(beta.dtype).requires_grad_(),
            lam=(0.25 + F.softplus(self_check.normal(g, H, K))).to(lam.dtype).requires_grad_(),
        )
        if initial_state is not None:
            x.update(G0=self_check.normal(g, B, H, K, K, scale=0.1).requires_grad_(),
                     H0=(M @ M.mT / K).requires_grad_())
        return x

    def run(backend):
        def call(G0=None, H0=None, **x):
            out, (G, Hs) = mesa(**x, cg_steps=30, initial_state=None if G0 is None else (G0, H0),
                                chunk_size=chunk_size, backend=backend)
            return dict(out=out, G=G, H=Hs)

        return call

    return self_check.checked("mesa (fla chunk_mesa_net)", q.device, shape_class, run("fla"), run("torch"),
                              make_inputs, q.dtype, bounds="fla_mesa")


@functools.cache
def _triton_kernels():
    """lm.ops.mesa_triton, or None where Triton is not installed (imported on first use: TRITON_INTERPRET is read
    when the kernels are defined)."""

    def load():
        from lm.ops import mesa_triton

        return mesa_triton

    return import_kernels(load)


# Eager under torch.compile: the autograd Function writes its CG telemetry into a dict in forward and backward.
# (torch._disable_dynamo is torch.compiler.disable without importing dynamo until the first call: lm.ops.self_check.)
@torch._disable_dynamo
def _apply_eagerly(*args):
    """`_MesaFunction.apply`, left out of torch.compile: a named graph break at this call; the mixer's other layers
    still compile. Dynamo cannot trace the info dict's updates (side effects inside the Function, the backward's among
    them), and the CG loop with a tolerance stops on a data-dependent test, which would break the graph anyway."""
    return _MesaFunction.apply(*args)


@autocast_off()
def mesa_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    cg_steps: int = 30,
    cg_tol: float | None = None,
    initial_state: MesaState | None = None,
    reset: torch.Tensor | None = None,
    return_info: bool = False,
):
    """Recurrent Mesa layer, for decoding (T=1 with a carried state): per step, update the materialised G, H of every
    head and solve (H_t + diag(lam)) x = q_t with the same warm-started CG and stopping rule as `mesa`. The solve is
    differentiated implicitly, as in `mesa` (`_ImplicitSolve`); the rest by plain autograd. Same arguments and results
    as `mesa`."""
    _check_inputs(q, k, v, log_gamma, beta, lam, initial_state, cg_steps, cg_tol, reset)
    in_dtype, dtype = q.dtype, compute_dtype(q)
    q, k, v, log_gamma, beta, lam = (x.to(dtype) for x in (q, k, v, log_gamma, beta, lam))
    gammas = log_gamma.exp()
    if reset is not None:  # a cleared state is a zero decay
        gammas = gammas * keep_state(reset, dtype)[..., None]
    G, H = _initial_state(initial_state, q, v.shape[-1], dtype)
    outs, iterations, residuals, diagonals = [], [], [], []
    for t in range(q.shape[1]):
        gamma = gammas[:, t, :, None, None]  # [B, H, 1, 1]
        k_beta = k[:, t] * beta[:, t, :, None]
        G = gamma * G + torch.einsum("bhv,bhk->bhvk", v[:, t], k_beta)
        H = gamma * H + torch.einsum("bhk,bhl->bhkl", k_beta, k[:, t])
        x = q[:, t]
        if cg_steps > 0:
            diagonals.append(H.diagonal(dim1=-2, dim2=-1).detach())
            x, used = _ImplicitSolve.solve(H, lam, q[:, t], cg_steps, cg_tol)
            if return_info:
                iterations.append(used)
                residuals.append(_true_residual(_ImplicitSolve.matvec(H, lam), q[:, t], x))
        outs.append(torch.einsum("bhvk,bhk->bhv", G, x))
    out = torch.stack(outs, dim=1).to(in_dtype)
    if not return_info:
        return out, (G, H)
    if cg_steps == 0:
        return out, (G, H), _info_without_solve(q)
    iterations = torch.stack(iterations, 1)  # [B, T, H]; each step's loop runs its slowest (batch, head)
    return out, (G, H), _solve_stats(iterations, torch.stack(residuals, 1), torch.stack(diagonals, 1), lam,
                                     run=iterations.amax(dim=(0, 2)).float().mean())


# ----------------------------------------------------------------------------------------------------------------------
# conjugate gradients


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token dot product over the last (K) axis (one kernel, no [.., K] temporary)."""
    return torch.linalg.vecdot(a, b)


def _cg(matvec, b: torch.Tensor, x0: torch.Tensor, steps: int, tol: float | None):
    """Textbook conjugate gradients for A x = b: one independent K-dimensional SPD system per token (and head), all
    solved in parallel. b, x0: [..., K]; matvec(p) = A p in the same layout.

    Without tol every token takes all `steps` steps (a token whose residual reaches exactly 0 takes zero-length
    ones, which keeps the divisions finite). With tol, a token is frozen (alpha = 0, so x and r stay as they are)
    once CG's recursive residual satisfies ||r|| <= tol ||r_0||, and the loop stops when every token is frozen.
    Returns (x, steps taken per token [...]).
    """
    x = x0
    r = b - matvec(x)
    p = r
    rs_old = _dot(r, r)
    threshold = 0.0 if tol is None else tol**2 * rs_old
    active = rs_old > threshold
    iterations = torch.zeros_like(rs_old)
    for _ in range(steps):
        # Checking costs a device sync per step, so only when early stopping is possible at all.
        if tol is not None and not active.any():
            break
        Ap = matvec(p)
        pAp = _dot(p, Ap)
        ok = active & (pAp > 0)
        alpha = torch.where(ok, rs_old / torch.where(ok, pAp, 1.0), 0.0)[..., None]
        x = torch.addcmul(x, alpha, p)  # fused multiply-adds: on the CPU these vector updates cost as much as A p
        r = torch.addcmul(r, alpha, Ap, value=-1)
        rs_new = _dot(r, r)
        beta = torch.where(rs_old > 0, rs_new / torch.where(rs_old > 0, rs_old, 1.0), 0.0)
        p = torch.addcmul(r, beta[..., None], p)
        if tol is None:
            iterations = iterations + 1
        else:
            iterations = iterations + active.to(iterations.dtype)
            active = active & (rs_new > threshold)
        rs_old = rs_new
    return x, iterations


class _ImplicitSolve(torch.autograd.Function):
    """y = A^{-1} rhs by `_cg` for a constant A = H + diag(lam) [B, H, K, K]; the backward is the adjoint solve
    A^{-1} dy (A is symmetric). `solve` builds x = A^{-1} q with the implicit gradient A^{-1}(dq - dA x) from it."""

    @staticmethod
    def forward(ctx, rhs, H, lam, steps, tol):
        ctx.save_for_backward(H, lam)
        ctx.steps, ctx.tol = steps, tol
        return _ImplicitSolve.cg(H, lam, rhs, steps, tol)[0]

    @staticmethod
    @once_differentiable
    @autocast_off()  # the engine runs a backward under the caller's autocast
    def backward(ctx, grad):
        H, lam = ctx.saved_tensors
        return _ImplicitSolve.cg(H, lam, grad, ctx.steps, ctx.tol)[0], None, None, None, None

    @staticmethod
    def matvec(H, lam):
        """p -> (H + diag(lam)) p, per batch and head."""
        return lambda p: torch.einsum("bhkl,bhl->bhk", H, p) + lam * p

    @staticmethod
    def cg(H, lam, b, steps, tol):
        """`_cg` warm-started at the Jacobi guess b / diag(A), as in `mesa`."""
        return _cg(_ImplicitSolve.matvec(H, lam), b, b / (H.diagonal(dim1=-2, dim2=-1) + lam), steps, tol)

    @staticmethod
    def solve(H, lam, q, steps, tol):
        """(x, CG steps taken): x = A^{-1} q, solved without a graph; where a gradient is wanted, x carries that of y,
        the solve of the residual q - A x against a constant A, dy = A^{-1}(dq - dA x), and not its value (which
        would refine a truncated solve)."""
        with torch.no_grad():
            x, used = _ImplicitSolve.cg(H, lam, q, steps, tol)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (H, lam, q)):
            residual = q - _ImplicitSolve.matvec(H, lam)(x)
            y = _ImplicitSolve.apply(residual, H.detach(), lam.detach(), steps, tol)
            x = x + (y - y.detach())
        return x, used


def _true_residual(matvec, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """||b - A x|| / ||b|| per token (0 where b = 0), from one more matvec: what the solve achieved, unlike CG's
    recursively updated residual, which keeps shrinking below it once rounding dominates."""
    with torch.no_grad():
        norm_b = _dot(b, b).sqrt()
        r = b - matvec(x)
        return torch.where(norm_b > 0, _dot(r, r).sqrt() / torch.where(norm_b > 0, norm_b, 1.0), 0.0)


def _solve_stats(iterations: torch.Tensor, residual: torch.Tensor, diag_h: torch.Tensor, lam: torch.Tensor,
                 prefix: str = "", run: torch.Tensor | None = None) -> dict:
    """The info dict of `return_info=True` from per-token results of one solve (iterations and true relative residual
    [B, T, H] in any layout; diag(H_t) [B, T, H, K], or any tensor holding its largest values), as detached 0-dim
    float32 tensors (no device sync): mean CG steps, the steps run, mean and max residual, and max diag(H_t) / min lam
    (see `mesa`). `run` is the CG steps the code ran per token, mean over tokens and heads: a loop over many tokens
    runs until its last one has converged (`_run_per_program`); by default the whole call is one loop, which runs
    its slowest token's steps. `prefix` names the adjoint solve's entries."""
    iterations = iterations.detach().float()
    stats = {
        "iterations": iterations.mean(),
        "iterations_run": iterations.max() if run is None else run.detach().float(),
        "residual": residual.detach().float().mean(),
        "residual_max": residual.detach().float().max(),
    }
    if not prefix:
        stats["diag_ratio"] = (diag_h.detach().max() / lam.detach().min()).float()
    return {prefix + key: value for key, value in stats.items()}


def _run_per_program(iterations: torch.Tensor, group: int) -> torch.Tensor:
    """The CG steps run per token, mean over tokens, where each program of `group` consecutive tokens along the last
    axis (a chunk of lm's Triton kernel; padded with tokens that take no step) stops with its last token."""
    pad = -iterations.shape[-1] % group
    grouped = torch.nn.functional.pad(iterations.detach().float(), (0, pad)).unflatten(-1, (-1, group))
    return grouped.amax(-1).mean()


def _info_without_solve(q: torch.Tensor) -> dict:
    """cg_steps=0: no CG step was taken, so nothing of the starting residual was removed (relative residual 1)."""
    zero = q.new_zeros((), dtype=torch.float32)
    return {"iterations": zero, "iterations_run": zero, "residual": zero + 1, "residual_max": zero + 1}


# ----------------------------------------------------------------------------------------------------------------------
# chunkwise form


class _ChunkedKeyState:
    """The key covariances H_t = gamma_t H_{t-1} + beta_t k_t k_t^T for all t, held in chunked form, so that H_t p_t
    (for all t at once) and diag(H_t) cost a few batched matmuls and no [T, K, K] tensor is formed.

    This is `linear_attention(p, k, k, log_gamma, beta, initial_state=H_0^T)` split into the parts that do not depend
    on p (computed once here) and the part that does (`matvec`). With b_i the cumulative log-decay inside a chunk and
    H_n the state entering chunk n:
        H_i p_i = sum_{j<=i} exp(b_i - b_j) beta_j (p_i . k_j) k_j + exp(b_i) H_n p_i.
    """

    def __init__(self, k, log_gamma, beta, H0, reset, chunk_size: int, dtype: torch.dtype):
        self.k = to_head_chunks(k, chunk_size, dtype)  # [B, H, N, C, K], zero-padded tail
        beta = to_head_chunks(beta, chunk_size, dtype)  # [B, H, N, C]
        b = to_head_chunks(log_gamma, chunk_size, dtype).cumsum(-1)  # [B, H, N, C]
        docs = ChunkDocuments.of(reset, chunk_size, dtype)
        to_end, from_start, chunk_decay = (b[..., -1:] - b).exp(), b.exp(), b[..., -1:].exp()
        if docs is not None:  # products of decays across a reset are 0 (see ChunkDocuments)
            to_end, from_start = to_end * docs.to_end, from_start * docs.from_start
            chunk_decay = chunk_decay * docs.whole
        self.weights = causal_decay(b, docs) * beta[..., None, :]  # exp(b_i - b_j) beta_j for j <= i: [B, H, N, C, C]
        self.from_start = from_start[..., None]  # decay of the entering state up to step i: [B, H, N, C, 1]
        # What each chunk adds, decayed to its end; then the short sequential pass over chunks.
        k_to_end = self.k * (to_end * beta)[..., None]
        added = torch.einsum("bhnck,bhncl->bhnkl", k_to_end, self.k)  # [B, H, N, K, K]
        state, entering = H0.to(dtype), []
        for n in range(self.k.shape[2]):
            entering.append(state)
            state = chunk_decay[:, :, n, :, None] * state + added[:, :, n]
        self.entering = torch.stack(entering, dim=2)  # [B, H, N, K, K]
        self.final = state  # H_T

    def matvec(self, p: torch.Tensor) -> torch.Tensor:
        """H_t p_t for every step: p [B, H, N, C, K] -> [B, H, N, C, K]."""
        intra = (p @ self.k.mT).mul_(self.weights) @ self.k
        # Row vectors: (H p)^T = p^T H^T.
        return intra.add_((p * self.from_start) @ self.entering.mT)

    def diagonal(self) -> torch.Tensor:
        """diag(H_t) for every step, [B, H, N, C, K]: the same decayed sums with k_j^2 for the outer products."""
        carried = self.from_start * self.entering.diagonal(dim1=-2, dim2=-1)[..., None, :]
        return self.weights @ (self.k * self.k) + carried


def _solve(H_op: _ChunkedKeyState, lam: torch.Tensor, b: torch.Tensor, steps: int, tol: float | None, chunk_size: int,
           stats: dict | None = None, prefix: str = ""):
    """Solve (H_t + diag(lam)) x_t = b_t for every token and head by warm-started CG; b: [B, T, H, K] -> x, same shape.

    Works in the chunked layout (padded tokens have b = 0 and take no step). With a `stats` dict, also measures the
    true residual (one more matvec) and adds `_solve_stats` under `prefix`.
    """
    T = b.shape[1]
    lam = lam[None, :, None, None, :]  # [1, H, 1, 1, K], broadcast over batch, chunks and steps
    b = to_head_chunks(b, chunk_size, H_op.k.dtype)
    diag_h = H_op.diagonal()
    matvec = lambda p: torch.addcmul(H_op.matvec(p), lam, p)
    x, iterations = _cg(matvec, b, b / (diag_h + lam), steps, tol)  # Jacobi warm start
    if stats is not None:
        unchunk = lambda t: from_head_chunks(t[..., None], T)[..., 0]
        residual = _true_residual(matvec, b, x)
        stats.update(_solve_stats(unchunk(iterations), unchunk(residual), diag_h, lam, prefix))
    return from_head_chunks(x, T)


class _TorchSolver:
    """The forward solve with its readout, and the adjoint solve, in the torch code (the reference)."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def forward(self, q, k, v, log_gamma, beta, lam, G0, H0, reset, steps, tol, info):
        """(out = G_t x_t in q's dtype, x = A_t^{-1} q_t, G_T, H_T), the solve's statistics into `info`."""
        dtype, chunk_size = G0.dtype, self.chunk_size
        H_op = _ChunkedKeyState(k, log_gamma, beta, H0, reset, chunk_size, dtype)
        x = _solve(H_op, lam.to(dtype), q, steps, tol, chunk_size, info)
        out, G_T = linear_attention(x, k, v, log_gamma, beta, initial_state=G0.mT, reset=reset, chunk_size=chunk_size,
                                    backend="torch")
        return out.to(q.dtype), x, G_T.mT.contiguous(), H_op.final

    def adjoint(self, d_out, k, v, log_gamma, beta, lam, G0, H0, reset, steps, tol, info):
        """e_t = A_t^{-1} G_t^T do_t. G_t^T do_t is linear attention with do as query, the values as keys and the keys
        as values (state G_t itself, [V, K])."""
        dtype, chunk_size = G0.dtype, self.chunk_size
        rhs, _ = linear_attention(d_out.to(dtype), v, k, log_gamma, beta, initial_state=G0, reset=reset,
                                  chunk_size=chunk_size, backend="torch")
        H_op = _ChunkedKeyState(k, log_gamma, beta, H0, reset, chunk_size, dtype)  # recomputed: cheap, saves memory
        return _solve(H_op, lam.to(dtype), rhs, steps, tol, chunk_size, info, prefix="adjoint_")


class _TritonSolver:
    """The same two solves by lm's Triton kernels (lm/ops/mesa_triton.py): the chunk-entry states once per solve,
    then one program per (chunk, batch x head) runs all its CG steps, the forward's readout and the adjoint's
    right-hand side included. The surrogate's linear attention stays the torch code's (`chunk_size`)."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self.kernels = _triton_kernels()

    def entry_states(self, k, v, log_gamma, beta, G0, H0, reset):
        """The kernels' chunk, (G entering every chunk, G_T), (H entering every chunk, H_T)."""
        chunk = self.kernels.kernel_chunk(self.chunk_size, k.shape[-1], v.shape[-1])
        states = self.kernels.chunk_entry_states
        return (chunk, states(k, v, log_gamma, beta, G0, reset, chunk, G0.dtype),
                states(k, k, log_gamma, beta, H0, reset, chunk, H0.dtype))

    def forward(self, q, k, v, log_gamma, beta, lam, G0, H0, reset, steps, tol, info):
        chunk, (G_in, G_T), (H_in, H_T) = self.entry_states(k, v, log_gamma, beta, G0, H0, reset)
        x, out, stats = self.kernels.chunk_solve(q, k, v, log_gamma, beta, lam, G_in, H_in, reset, chunk, steps, tol,
                                                 adjoint=False, out_dtype=q.dtype)
        if info is not None:
            info.update(_solve_stats(*stats, lam, run=_run_per_program(stats[0], chunk)))
        return out, x, G_T, H_T

    def adjoint(self, d_out, k, v, log_gamma, beta, lam, G0, H0, reset, steps, tol, info):
        chunk, (G_in, _), (H_in, _) = self.entry_states(k, v, log_gamma, beta, G0, H0, reset)
        e, _, stats = self.kernels.chunk_solve(d_out, k, v, log_gamma, beta, lam, G_in, H_in, reset, chunk, steps, tol,
                                               adjoint=True, out_dtype=G0.dtype)
        if info is not None:
            info.update(_solve_stats(*stats, lam, prefix="adjoint_", run=_run_per_program(stats[0], chunk)))
        return e


@dataclass
class _Solve:
    """What `_MesaFunction` needs besides the tensors it differentiates: the solver, the stopping rule, the resets,
    and the info dict (None: not asked for), which the forward fills and the backward adds the adjoint's entries to."""

    solver: _TorchSolver | _TritonSolver
    steps: int
    tol: float | None
    reset: torch.Tensor | None
    info: dict | None


class _MesaFunction(torch.autograd.Function):
    """Forward: warm-started chunkwise CG and the readout. Backward: the adjoint CG solve and the surrogate (see the
    module docstring); the forward iterations are not unrolled, only x is kept. `solve.solver` does the two solves."""

    @staticmethod
    def forward(ctx, q, k, v, log_gamma, beta, lam, G0, H0, solve: _Solve):
        out, x, G_T, H_T = solve.solver.forward(q, k, v, log_gamma, beta, lam, G0, H0, solve.reset, solve.steps,
                                                solve.tol, info=solve.info)
        ctx.save_for_backward(k, v, log_gamma, beta, lam, G0, H0, x)
        ctx.solve, ctx.q_dtype = solve, q.dtype
        ctx.set_materialize_grads(False)
        return out, G_T, H_T

    @staticmethod
    @once_differentiable
    @autocast_off()
    def backward(ctx, d_out, d_G, d_H):
        k, v, log_gamma, beta, lam, G0, H0, x = ctx.saved_tensors
        solve = ctx.solve
        e = None
        if d_out is not None:
            e = solve.solver.adjoint(d_out, k, v, log_gamma, beta, lam, G0, H0, solve.reset, solve.steps, solve.tol,
                                     info=solve.info)
        grads = _surrogate_grads((k, v, log_gamma, beta, lam, G0, H0), ctx.needs_input_grad[1:8], x, e, d_out, d_G,
                                 d_H, solve.reset, solve.solver.chunk_size)
        dq = e.to(ctx.q_dtype) if e is not None and ctx.needs_input_grad[0] else None
        return (dq, *grads, None)


def _surrogate_grads(inputs, needs_grad, x, e, d_out, d_G, d_H, reset, chunk_size):
    """Gradients w.r.t. (k, v, log_gamma, beta, lam, G0, H0) by autograd through the surrogate
    S = do.(G x) - e.(H x) - e.(lam x) + <dG_T, G_T> + <dH_T, H_T>, with x and e constants."""
    leaves = [t.detach().requires_grad_(needs) for t, needs in zip(inputs, needs_grad)]
    wanted = [leaf for leaf in leaves if leaf.requires_grad]
    if not wanted:
        return [None] * len(leaves)
    k, v, log_gamma, beta, lam, G0, H0 = leaves
    dtype = x.dtype
    terms = []
    with torch.enable_grad():
        if d_out is not None or d_G is not None:
            Gx, G_T = linear_attention(x, k, v, log_gamma, beta, initial_state=G0.mT, reset=reset,
                                       chunk_size=chunk_size, backend="torch")
            if d_out is not None:
                terms.append(_dot(d_out.to(dtype), Gx).sum())
            if d_G is not None:
                terms.append((d_G.to(dtype) * G_T.mT).sum())
        if e is not None or d_H is not None:
            # H_0^T as the initial state: linear attention reads S^T p, so this gives H_t p (and the gradient w.r.t.
            # H_0 in H_0's own orientation, should H_0 not be exactly symmetric).
            Hx, H_T = linear_attention(x, k, k, log_gamma, beta, initial_state=H0.mT, reset=reset,
                                       chunk_size=chunk_size, backend="torch")
            if e is not None:
                terms.append(-_dot(e, Hx).sum() - _dot(e, lam.to(dtype) * x).sum())
            if d_H is not None:
                terms.append((d_H.to(dtype) * H_T.mT).sum())
        surrogate = sum(terms)
        if not isinstance(surrogate, torch.Tensor) or not surrogate.requires_grad:
            return [None] * len(leaves)
        found = iter(torch.autograd.grad(surrogate, wanted, allow_unused=True))
    return [next(found) if leaf.requires_grad else None for leaf in leaves]


def _linear_attention_readout(q, k, v, log_gamma, beta, initial_state, reset, chunk_size, return_info, backend):
    """cg_steps=0: o_t = G_t q_t, which is gated linear attention with query q (plain autograd through it). H_T is
    still carried, so that a later call (or decoding) with cg_steps > 0 can continue from the state."""
    dtype = compute_dtype(q)
    G0, H0 = _initial_state(initial_state, q, v.shape[-1], dtype)
    out, G_T = linear_attention(q, k, v, log_gamma, beta, initial_state=G0.mT, reset=reset, chunk_size=chunk_size,
                                backend=backend)
    state = (G_T.mT, _final_key_state(k, log_gamma, beta, H0, reset))
    if return_info:
        return out, state, _info_without_solve(q)
    return out, state


def _final_key_state(k, log_gamma, beta, H0, reset):
    """H_T = exp(sum log_gamma) H_0 + sum_s exp(sum_{u>s} log_gamma_u) beta_s k_s k_s^T, in one pass.

    The decay after step s is a reverse cumulative sum of the log-decays (not total minus a forward cumsum, which
    cancels badly in float32 for long, strongly decaying sequences); every exponent is <= 0. A reset after step s
    (or anywhere, for H_0) multiplies its term by 0."""
    dtype = H0.dtype
    log_gamma = log_gamma.to(dtype)
    after = log_gamma.flip(1).cumsum(1).flip(1) - log_gamma  # sum_{u>s} log_gamma_u: [B, T, H]
    decay_after, decay_all = after.exp(), log_gamma.sum(1).exp()  # [B, T, H], [B, H]
    if reset is not None:
        resets_after = reset.flip(1).int().cumsum(1).flip(1) - reset.int()  # resets in (s, T): [B, T]
        decay_after = decay_after * (resets_after == 0).to(dtype)[..., None]
        decay_all = decay_all * (~reset.any(1)).to(dtype)[:, None]
    k = k.to(dtype)
    weighted = k * (decay_after * beta.to(dtype))[..., None]
    return decay_all[..., None, None] * H0 + torch.einsum("bthk,bthl->bhkl", weighted, k)


# ----------------------------------------------------------------------------------------------------------------------
# inputs


def _initial_state(initial_state: MesaState | None, q: torch.Tensor, V: int, dtype: torch.dtype) -> MesaState:
    """(G_0, H_0) in the compute dtype: the given pair, or zeros."""
    if initial_state is not None:
        return initial_state[0].to(dtype), initial_state[1].to(dtype)
    B, _, H, K = q.shape
    return q.new_zeros(B, H, V, K, dtype=dtype), q.new_zeros(B, H, K, K, dtype=dtype)


def _check_inputs(q, k, v, log_gamma, beta, lam, initial_state, cg_steps, cg_tol, reset) -> None:
    """Fail early with the contract's shapes and settings. lam > 0 is not checked (that would sync the device)."""
    if beta is None:
        raise ValueError("mesa: beta is required ([B, T, H]); pass ones for no input gate")
    check_shapes(q, k, v, None, reset=reset, log_gamma=log_gamma, beta=beta)
    B, _, H, K = q.shape
    V = v.shape[-1]
    if lam.shape != (H, K):
        raise ValueError(f"expected lam [H, K] = {(H, K)}, got {tuple(lam.shape)}")
    if initial_state is not None:
        if len(initial_state) != 2:
            raise ValueError("expected initial_state = (G [B, H, V, K], H [B, H, K, K])")
        G0, H0 = initial_state
        if G0.shape != (B, H, V, K) or H0.shape != (B, H, K, K):
            raise ValueError(
                f"expected initial_state (G {(B, H, V, K)}, H {(B, H, K, K)}), got "
                f"({tuple(G0.shape)}, {tuple(H0.shape)})"
            )
    if not isinstance(cg_steps, int) or cg_steps < 0:
        raise ValueError(f"cg_steps must be a non-negative int, got {cg_steps!r}")
    if cg_tol is not None and not (cg_tol > 0 and math.isfinite(cg_tol)):
        raise ValueError(f"cg_tol must be None or a positive number, got {cg_tol!r}")

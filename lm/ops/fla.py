"""Optional GPU dispatch to flash-linear-attention (`fla`) Triton kernels.

fla is imported lazily: it needs CUDA and Triton, and the pure-PyTorch ops must work without it. The glue adapts our
conventions to fla's (checked against fla-core 0.6.0's source):
- layout: fla also takes [B, T, H, *] (`head_first` defaults to False from fla 0.2 on and is rejected by 0.6);
- gates: `g` is the per-step log-decay, which fla cumsums itself ([B, T, H] for simple_gla, [B, T, H, K] for gla,
  [B, T, D] for hgrn);
- scale: fla's default is 1/sqrt(K), so ours is always passed;
- beta: simple_gla and gla have none, so it is folded into the keys;
- the final state ([B, H, K, V], or [B, D] for hgrn) is only returned with `output_final_state=True`;
- resets (packed documents) go through fla's variable-length form, `cu_seqlens` (`_varlen_call`).
The first use of each kernel per device and shape class is checked once against the torch code (`fla_agrees`,
lm.ops.self_check); where they disagree, the torch code runs.
"""

import functools
import importlib
import inspect
import warnings
from collections.abc import Callable

import torch

from lm.ops import self_check
from lm.ops.common import warn_once
from lm.ops.kernel_packages import import_kernels

BACKENDS = ("auto", "torch", "fla")

# The self-check's length: two of fla's chunks of 64 and an odd tail.
CHECK_T = 2 * 64 + 3

# fla's kernels are written for half precision; its delta-rule entry points assert that the inputs are not float32.
FLA_DTYPES = (torch.bfloat16, torch.float16)


def fla_imports(*modules: str) -> bool:
    """Whether fla's `modules` import (they need Triton). An installed fla that fails to import raises on a machine
    with CUDA (lm.ops.kernel_packages). Callers cache the answer, since a failed import is slow to retry."""
    return bool(import_kernels(lambda: [importlib.import_module(module) for module in modules]))


@functools.cache
def fla_available() -> bool:
    """Whether flash-linear-attention's kernels for linear_attention and delta_rule import; cached."""
    return fla_imports("fla.ops.delta_rule", "fla.ops.gated_delta_rule", "fla.ops.simple_gla")


def check_fla_backend(op: str, tensors, available: Callable[[], bool],
                      package: str = "flash-linear-attention") -> None:
    """Raise, with the fix, where backend='fla' cannot run `op`: `tensors` (None among them skipped) not all on CUDA,
    or `available()` false (`package`, fla or the part of it that `op` needs, does not import)."""
    if not all(t.is_cuda for t in tensors if t is not None):
        raise RuntimeError(f"{op}: backend='fla' needs CUDA tensors; use backend='torch' (or 'auto') on CPU")
    if not available():
        raise ImportError(f"{op}: backend='fla' needs {package}; install it with `pip install -e .[gpu]` (or `pip "
                          "install flash-linear-attention`), or use backend='torch'")


def check_fla_dtype(op: str, dtype: torch.dtype) -> None:
    """Raise where fla's kernels cannot take inputs of `dtype` (they assert half precision)."""
    if dtype not in FLA_DTYPES:
        raise TypeError(f"{op}: fla's kernels need bf16/fp16 inputs, got {dtype}; use backend='torch'")


def fla_refuses_gated_backward(kernel: str) -> bool:
    """Whether fla refuses the backward of its gated chunk kernel `kernel` here ("simple_gla": Mamba2's
    linear_attention; "gated_delta_rule"). fla 0.6 does on Hopper GPUs with Triton >= 3.4 and < 3.7.1, whose results
    were wrong there (fla's issue #640; seen on the lent H200, Triton 3.6.0, docs/performance-history.md, "GPU"),
    unless its TileLang backend takes the backward instead. TileLang takes it only where it is installed, finds a
    usable nvcc and is enabled, and never for simple_gla (fla's TileLang kernel declines its float32 states)."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # fla versions without the guard
        return False
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return False
    return kernel == "simple_gla" or not _tilelang_takes_gated_backward()


@functools.cache
def _tilelang_takes_gated_backward() -> bool:
    """Whether fla's TileLang backend is installed, usable (tilelang and an nvcc) and enabled (FLA_TILELANG, on by
    default exactly where Triton's gated backward is refused)."""
    try:
        from fla.ops.common.backends.tilelang import TileLangBackend
    except ImportError:
        return False
    return bool(TileLangBackend.is_available() and TileLangBackend.is_enabled())


def use_fla(backend: str, *tensors: torch.Tensor | None, op: str, gated_kernel: str | None = None,
            available: Callable[[], bool] | None = None) -> bool:
    """Resolve `backend` for `op`: True to call fla, False for the pure-PyTorch code. `available`: whether the part
    of fla that `op` needs imports (None: `fla_available`, linear_attention's and delta_rule's kernels).

    "torch" never uses fla; "fla" always does and raises if it cannot; "auto" uses fla only for CUDA tensors in
    bf16/fp16 when fla imports (float32/float64 inputs go to the exact torch code, which fla's delta-rule kernels
    would reject anyway), and for a gated kernel (`gated_kernel`, fla's name for it) that will be differentiated only
    where fla does not refuse its backward (`fla_refuses_gated_backward`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "fla":
        check_fla_backend(op, tensors, available or fla_available)
        return True
    return all(t.is_cuda for t in tensors if t is not None) and auto_uses_fla(op, tensors[0].dtype, gated_kernel,
                                                                              available)


def auto_uses_fla(op: str, dtype: torch.dtype, gated_kernel: str | None = None,
                  available: Callable[[], bool] | None = None) -> bool:
    """"auto" on CUDA: whether fla takes `op` for inputs of `dtype`. Where it does not, the torch code runs, several
    times slower, and that is said once with the reason and the fix (`warn_once`)."""
    reason = fix = None
    if not (available or fla_available)():
        reason, fix = "flash-linear-attention does not import", "install it with `pip install -e .[gpu]`"
    elif dtype not in FLA_DTYPES:
        reason, fix = f"its inputs are {dtype} and fla's kernels take bf16/fp16", "train with bf16-mixed precision"
    elif gated_kernel and torch.is_grad_enabled() and fla_refuses_gated_backward(gated_kernel):
        reason = f"fla refuses the backward of chunk_{gated_kernel} with this Triton on Hopper (fla issue #640)"
        fix = "Triton >= 3.7.1 restores fla (`make gpu-triton` packs one for a lent machine)"
    if reason is None:
        return True
    warn_once(f"{op}: the torch code runs on CUDA, not fla's kernel: {reason}; {fix}.")
    return False


def fla_agrees(op: str, kernel: str, run: Callable[[str], Callable], make_inputs: Callable, like: torch.Tensor,
               shape_class: tuple, gated_kernel: str | None = None) -> bool:
    """Whether fla's `kernel` may run `op` here: its self-check against the torch code (lm.ops.self_check), once per
    device and shape class, with the bound of tests/test_ops_gpu.py. run(backend) is the op with that backend,
    make_inputs the small seeded input, `like` the call's first tensor (device and dtype). Checked whether "auto"
    picked fla or the call named it: a named backend asks for the same numbers, faster. Where fla refuses the gated
    kernel's backward (`fla_refuses_gated_backward`), only the forward is compared: the backward would raise."""
    grads = not (gated_kernel and fla_refuses_gated_backward(gated_kernel))
    return self_check.checked(f"{op} (fla {kernel})", like.device, (*shape_class, "grads" if grads else "forward"),
                              run("fla"), run("torch"), make_inputs, like.dtype, bounds="fla", grads=grads)


def parameters(fn) -> dict[str, inspect.Parameter]:
    """The parameters of an fla entry point by name; none where its signature cannot be read."""
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _layout_kwargs(fn) -> dict:
    """`head_first=False` for old fla versions whose default was head-first [B, H, T, *]; nothing for newer ones.

    Recent fla versions raise if `head_first` is passed at all, so it is only passed when the signature has it with a
    default other than False.
    """
    param = parameters(fn).get("head_first")
    if param is not None and param.default is not False:
        return {"head_first": False}
    return {}


def fla_call(fn, **kwargs):
    """Call an fla entry point, silencing its layout heuristic (it warns when T < H, which is normal for decoding)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Input tensor shape suggests")
        return fn(**kwargs, **_layout_kwargs(fn))


def _initial_state(initial_state: torch.Tensor | None) -> torch.Tensor | None:
    return None if initial_state is None else initial_state.float()


def _run(fn, reset: torch.Tensor | None, rows_per_token: int = 1, **kwargs):
    """`fla_call(fn, **kwargs)`, or with resets its variable-length form (`_varlen_call`)."""
    if reset is None:
        return fla_call(fn, **kwargs)
    return _varlen_call(fn, reset, rows_per_token, **kwargs)


def _varlen_call(fn, reset: torch.Tensor, rows_per_token: int = 1, **kwargs):
    """A call with resets as fla runs packed documents (flame's varlen training): the batch flattened into one row of
    B * T steps, and `cu_seqlens` the offsets where its sequences start (every row's start, and every reset).

    Each row's first sequence continues that row's initial state (each `initial_*` among kwargs, [B, ...]), unless the
    row starts with a reset; every other sequence starts from zeros. The final state of a row is that of its last
    sequence (each state fn returns after the output). The [B, T, ...] tensors among kwargs (q, k, v, g, beta, x),
    and the [B, T * rows_per_token, ...] ones (DeltaProduct's k, v and beta), are flattened; the others pass as they
    are. Costs one device sync (the offsets).
    """
    B, T = reset.shape
    starts = reset.clone()
    starts[:, 0] = True
    offsets = starts.flatten().nonzero().squeeze(1)  # [N], where each sequence starts in the flat row
    cu_seqlens = torch.cat([offsets, offsets.new_tensor([B * T])])
    first = torch.searchsorted(offsets, torch.arange(B, device=offsets.device) * T)  # each row's first sequence
    last = torch.cat([first[1:], first.new_tensor([len(offsets)])]) - 1
    states = {}
    for name in [name for name in kwargs if name.startswith("initial_")]:
        state = kwargs.pop(name)
        if state is not None:
            continues = (~reset[:, 0]).to(state.dtype).view(B, *[1] * (state.dim() - 1))
            state = state.new_zeros(len(offsets), *state.shape[1:]).index_put((first,), state * continues)
        states[name] = state
    timed = ((B, T), (B, T * rows_per_token))
    flat = {name: x.flatten(0, 1)[None] if torch.is_tensor(x) and x.shape[:2] in timed else x
            for name, x in kwargs.items()}
    out, *finals = fla_call(fn, cu_seqlens=cu_seqlens, **states, **flat)
    return out.view(B, T, *out.shape[2:]), *(final[last] for final in finals)


def fla_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_attention` through fla.ops.simple_gla.chunk_simple_gla (a decay per head: `g` = log_gamma [B, T, H]),
    or fla.ops.gla.chunk_gla for a decay per key dimension (log_gamma [B, T, H, K]; checked against fla's source:
    chunk_gla(q, k, v, g, scale, initial_state, output_final_state), [B, T, H, *] layout)."""
    if log_gamma.dim() == 4:
        from fla.ops.gla import chunk_gla as kernel
    else:
        from fla.ops.simple_gla import chunk_simple_gla as kernel

    if beta is not None:
        # beta_t k_t v_t^T = (beta_t k_t) v_t^T, and the query side never sees beta, so folding it into k is exact.
        k = k.float() * beta.float()[..., None]
    out, state = _run(
        kernel,
        reset,
        q=q,
        k=k.to(q.dtype),  # fla's kernels expect q, k, v in one dtype
        v=v.to(q.dtype),
        g=log_gamma.float(),
        scale=float(scale),
        initial_state=_initial_state(initial_state),
        output_final_state=True,
    )
    return out.to(q.dtype), state.float()


def fla_diagonal_scan(
    x: torch.Tensor, log_a: torch.Tensor, initial_state: torch.Tensor | None, reset: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`diagonal_scan` through fla.ops.hgrn.fused_recurrent_hgrn(x, g, initial_state, output_final_state), g = log_a,
    h_t = exp(g_t) * h_{t-1} + x_t ([B, T, D], state [B, D]). Not chunk_hgrn: its backward returns no gradient for
    the initial state and ignores the final state's gradient. The kernel keeps h in float32 per step but stores the
    outputs and the final state in x's dtype."""
    from fla.ops.hgrn import fused_recurrent_hgrn

    out, state = _run(
        fused_recurrent_hgrn,
        reset,
        x=x,
        g=log_a.float(),
        initial_state=_initial_state(initial_state),
        output_final_state=True,
    )
    return out.to(x.dtype), state.float()


def fla_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_alpha: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule` through fla's chunk_delta_rule (log_alpha None) or chunk_gated_delta_rule (g = log_alpha)."""
    check_fla_dtype("delta_rule", q.dtype)
    common = dict(
        q=q,
        k=k.to(q.dtype),
        v=v.to(q.dtype),
        beta=beta.to(q.dtype),
        scale=float(scale),
        initial_state=_initial_state(initial_state),
        output_final_state=True,
    )
    if log_alpha is None:
        from fla.ops.delta_rule import chunk_delta_rule

        out, state = _run(chunk_delta_rule, reset, **common)
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        out, state = _run(chunk_gated_delta_rule, reset, g=log_alpha.float(), **common)
    return out.to(q.dtype), state.float()


@functools.cache
def kda_available() -> bool:
    """Whether fla's KDA and GDN-2 kernels import (fla-core >= 0.6); cached."""
    return fla_imports("fla.ops.kda", "fla.ops.gdn2")


def fla_kda(q, k, v, log_alpha, beta, erase, write, scale, initial_state, reset=None):
    """`kda` through fla's chunk_kda (erase = write = beta, a scalar per head) or chunk_gdn2 (channel gates b [B, T,
    H, K], w [B, T, H, V]); both take g, the log-decay per key channel, which a decay per head is expanded to. Their
    state is [B, H, K, V] as lm's (fla's naive_recurrent_kda / naive_recurrent_gdn2)."""
    check_fla_dtype("kda", q.dtype)
    K, V = q.shape[-1], v.shape[-1]
    per_channel = lambda x, n: (x if x.dim() == 4 else x[..., None].expand(*x.shape, n)).contiguous()  # noqa: E731
    common = dict(q=q, k=k.to(q.dtype), v=v.to(q.dtype), g=per_channel(log_alpha.float(), K), scale=float(scale),
                  initial_state=_initial_state(initial_state), output_final_state=True)
    if beta is not None and erase is beta and write is beta:
        from fla.ops.kda import chunk_kda

        out, state = _run(chunk_kda, reset, beta=beta.to(q.dtype), **common)
    else:
        from fla.ops.gdn2 import chunk_gdn2

        out, state = _run(chunk_gdn2, reset, b=per_channel(erase.to(q.dtype), K), w=per_channel(write.to(q.dtype), V),
                          **common)
    return out.to(q.dtype), state.float()


@functools.cache
def delta_product_available() -> bool:
    """Whether fla's gated DeltaProduct kernel imports; cached."""
    return fla_imports("fla.ops.gated_delta_product")


def fla_delta_product(q, k, v, beta, log_alpha, scale, initial_state, reset=None):
    """`delta_product` through fla's chunk_gated_delta_product: the same layout (k, v, beta with T * n_h rows, the
    token's steps in order; g [B, T, H] or None), the gate applied once per token before its steps."""
    check_fla_dtype("delta_product", q.dtype)
    from fla.ops.gated_delta_product import chunk_gated_delta_product

    n_h = k.shape[1] // q.shape[1]
    out, state = _run(chunk_gated_delta_product, reset, rows_per_token=n_h, q=q, k=k.to(q.dtype), v=v.to(q.dtype),
                      g=None if log_alpha is None else log_alpha.float(), beta=beta.to(q.dtype), num_householder=n_h,
                      scale=float(scale), initial_state=_initial_state(initial_state), output_final_state=True)
    return out.to(q.dtype), state.float()


@functools.cache
def precond_available() -> bool:
    """Whether fla's preconditioned gated delta rule kernel imports; cached."""
    return fla_imports("fla.ops.precond_gated_delta_rule")


def fla_precond_delta_rule(q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale, squash, eps, center,
                           initial_state, reset=None):
    """`precond_delta_rule` through fla's chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, ...,
    x=squash, eps, log_atk_scale=center per head), with use_qk_l2norm_in_kernel=False: lm's op takes q and k as they
    come (the mixer normalises them), where fla's default normalises inside. State (S [B, H, K, V], A [B, H, K])."""
    check_fla_dtype("precond_delta_rule", q.dtype)
    from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule

    H = q.shape[2]
    S0, A0 = (None, None) if initial_state is None else initial_state
    g = torch.zeros_like(beta, dtype=torch.float32) if log_alpha is None else log_alpha.float()
    center = torch.as_tensor(center, dtype=torch.float32, device=q.device).expand(H).contiguous()
    out, S, A = _run(chunk_precond_gated_delta_rule, reset, q=q, k=k.to(q.dtype), v=v.to(q.dtype),
                     g_atk=log_alpha_a.float(), g=g, beta_atk=beta_a.to(q.dtype), beta=beta.to(q.dtype),
                     scale=float(scale), initial_state=_initial_state(S0), initial_A_state=_initial_state(A0),
                     output_final_state=True, use_qk_l2norm_in_kernel=False, x=float(squash), eps=float(eps),
                     log_atk_scale=center)
    return out.to(q.dtype), (S.float(), A.float())

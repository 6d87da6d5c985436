"""Fast paths check themselves (docs/design.md, "Op contract"): the first time a process runs a fast kernel (lm's Triton
Mesa kernels, flash-linear-attention's, mlstm_kernels', FlexAttention's, liger-kernel's loss) on a device, for a class
of calls whose code paths are the same (`shape_class`: the dtypes, the head sizes, resets or not...), it runs the kernel
once against the torch code on a small seeded input, outputs and gradients, in the dtype the run trains in. If they
agree within the bounds the GPU tests hold the kernel to (`BOUNDS`, which those tests read too), the kernel runs from
then on; if not, `lm` says so once, with the figures, and that class of calls runs the torch code from then on.

The verdict is kept per process, per (kernel, device, shape class). `LM_KERNEL_SELF_CHECK=0` skips the check (the
fast path then runs unchecked). A check costs one small forward and backward of each side, once: `verdicts()` has
the seconds each took (docs/performance.md, "Kernel self-check").

`checked` is generic: the dispatch points (lm.ops.mesa, lm.ops.fla's users, lm.ops.mlstm, lm.ops.cross_entropy,
lm.mixers.flex_masks) give it the two functions and the inputs. It runs them with gradients on (also under no_grad
or inference_mode), with autocast off unless asked to keep it, on fresh leaves drawn from its own torch.Generator
(the global RNG is not touched) and apart from the caller's autograd graph. While a kernel's check runs, a nested
call of the same kernel (the fast function calling the public op with that backend) runs the fast path unchecked."""

import contextlib
import math
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from lm.ops.common import autocast_off, warn_once

ENV = "LM_KERNEL_SELF_CHECK"
HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Bound:
    """The largest relative error ||fast - torch|| / ||torch|| (fla's measure, tests/gpu_helpers.err_ratio) allowed
    for each output and for each input's gradient."""

    out: float
    grad: float


@dataclass(frozen=True)
class Bounds:
    """A kernel's bounds for full-precision (float32 / float64) and half-precision (bf16 / fp16) inputs."""

    full: Bound
    half: Bound

    def __getitem__(self, dtype: torch.dtype) -> Bound:
        return self.half if dtype in HALF else self.full


# The one table of the bounds that the GPU tests hold each kernel to, against the torch code (or a float64
# reference); those tests read it from here. Where a test has no figure for a precision, the note says what is used.
BOUNDS = {
    # tests/test_ops_gpu.py: outputs, final states and every gradient, bf16 (fla's kernels take half precision; a
    # float32 call by name gets the same bound).
    "fla": Bounds(full=Bound(2e-2, 2e-2), half=Bound(2e-2, 2e-2)),
    # tests/test_ops_gpu_mesa.py::test_fla_matches_torch, bf16 (fla's CG is not ours: both converged, 30 steps).
    "fla_mesa": Bounds(full=Bound(5e-2, 5e-2), half=Bound(5e-2, 5e-2)),
    # float32: tests/test_ops_gpu_mesa.py::test_triton_matches_the_exact_solve (and the CPU's
    # tests/test_op_mesa_triton.py); bf16: tests/test_op_mesa_triton.py::test_bfloat16_inputs_are_solved_in_float32.
    "mesa_triton": Bounds(full=Bound(1e-4, 1e-3), half=Bound(4e-3, 4e-3)),
    # tests/test_ops_gpu_mlstm.py: output, states and the gradients but dq (the kernel's dq is known to differ and is
    # not compared), float32 (TF32 dots) and bf16.
    "mlstm_kernels": Bounds(full=Bound(2e-2, 2e-2), half=Bound(5e-2, 5e-2)),
    # float32: tests/test_flex_attention.py::test_cuda_auto_runs_compiled_flex_and_equals_cpu_sdpa; bf16 has no GPU
    # test of its own: fla's bf16 bound (the math form computes in float32 from the same bf16 inputs).
    "flex": Bounds(full=Bound(1e-4, 1e-4), half=Bound(2e-2, 2e-2)),
    # tests/test_model_gpu.py::test_head_loss_dispatches_to_liger_and_matches_the_chunked_torch_form: the loss
    # within 1e-2, dx and dW within 2e-2, under bf16 autocast as in training.
    "liger": Bounds(full=Bound(1e-2, 2e-2), half=Bound(1e-2, 2e-2)),
}


@dataclass
class Verdict:
    """One check: whether the fast path is kept, the seconds the check took, and per compared tensor (an output's name,
    or "d" + an input's name) its (relative error, max abs error, bound)."""

    ok: bool
    seconds: float
    errors: dict[str, tuple[float, float, float]] = field(default_factory=dict)


_verdicts: dict[tuple, Verdict] = {}
_running: set[str] = set()  # kernels whose check is under way (a nested call runs the fast path)


def enabled() -> bool:
    """Whether fast paths are checked: unless LM_KERNEL_SELF_CHECK is 0 (or false / off / no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def verdicts() -> dict[tuple, Verdict]:
    """The checks made in this process so far: {(kernel, device, shape class): Verdict}."""
    return dict(_verdicts)


def forget() -> None:
    """Drop every verdict (the tests' fresh start); the next use of each fast path is checked again."""
    _verdicts.clear()


def checked(name: str, device, shape_class: Hashable, fast_fn: Callable, reference_fn: Callable,
            make_inputs: Callable[[torch.Generator], dict], dtype: torch.dtype, *, bounds: str | None = None,
            grads: bool = True, keep_autocast: bool = False) -> bool:
    """Whether the fast path `name` may run on `device` for calls of `shape_class`: True where it agreed with the
    torch code (or the check is off), False where it did not (said once, with the figures).

    make_inputs(generator) gives the small input, a dict of keyword arguments (tensors drawn from the generator, on
    `device`, in `dtype` where the run trains in it; the floating-point ones that require grad are differentiated);
    fast_fn(**inputs) and reference_fn(**inputs) give a tensor, a tuple or a dict of tensors (None is skipped). The
    gradients are those of a fixed random projection of every output that requires grad. `bounds` names the row of
    BOUNDS (default: `name`); grads=False compares the outputs only; keep_autocast keeps the caller's autocast.
    Where either side raises, so does this (as the call itself would), and nothing is kept."""
    if not enabled() or name in _running:
        return True
    key = (name, str(torch.device(device)), shape_class)
    verdict = _verdicts.get(key)
    if verdict is None:
        verdict = _check(key, fast_fn, reference_fn, make_inputs, dtype, BOUNDS[bounds or name][dtype], grads,
                         keep_autocast)
    return verdict.ok


# A fast path's self-check runs once, eagerly, the first time it is met. torch._disable_dynamo is torch.compiler.disable
# applied at the first call: the latter imports torch._dynamo (about 1 CPU-s) when this module is imported, which
# `lm train` pays before it can refuse a config (lm.training.preflight).
@torch._disable_dynamo
def _check(key, fast_fn, reference_fn, make_inputs, dtype, bound: Bound, grads: bool, keep_autocast: bool) -> Verdict:
    name, device, shape_class = key
    start = time.perf_counter()
    _running.add(name)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad() if grads else torch.no_grad())
            if not keep_autocast:
                stack.enter_context(autocast_off())
            inputs = make_inputs(torch.Generator(device=device).manual_seed(0))
            fast = _outputs_and_grads(fast_fn, inputs, device, grads)
            reference = _outputs_and_grads(reference_fn, inputs, device, grads)
    finally:
        _running.discard(name)
    errors = _compare(fast, reference, bound)
    ok = all(error <= limit for error, _, limit in errors.values())  # NaN fails
    verdict = _verdicts[key] = Verdict(ok, time.perf_counter() - start, errors)
    if not ok:
        warn_once(_message(name, device, shape_class, dtype, errors))
    return verdict


def _outputs_and_grads(fn, inputs: dict, device, grads: bool) -> tuple[dict, dict]:
    """({output name: output}, {input name: gradient}) of fn on fresh copies of `inputs`. An output's name is the key
    fn gives it in a dict, "out" for a lone tensor, "out0", "out1"... in a tuple."""
    leaves = {name: t.detach().clone().requires_grad_(t.requires_grad and grads) if torch.is_tensor(t) else t
              for name, t in inputs.items()}
    outs = fn(**leaves)
    if torch.is_tensor(outs):
        outs = {"out": outs}
    elif not isinstance(outs, dict):
        outs = {f"out{i}": out for i, out in enumerate(outs)}
    outs = {name: out for name, out in outs.items() if out is not None}
    wanted = {name: t for name, t in leaves.items() if torch.is_tensor(t) and t.requires_grad}
    differentiable = [out for out in outs.values() if out.requires_grad]
    if not (grads and wanted and differentiable):
        return outs, {}
    projection = torch.Generator(device=device).manual_seed(1)  # the same weights for both sides
    loss = sum((_wide(out) * torch.randn(out.shape, generator=projection, device=out.device, dtype=_wide(out).dtype))
               .sum() for out in differentiable)
    return outs, dict(zip(wanted, torch.autograd.grad(loss, list(wanted.values()), allow_unused=True)))


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.dtype == torch.float64 else t.float()


def _compare(fast: tuple[dict, dict], reference: tuple[dict, dict], bound: Bound) -> dict:
    """{output name, or "d" + input name for a gradient: (relative error, max abs error, bound)}; a tensor that one
    side lacks, or of another shape, has an infinite error."""
    errors = {}
    for prefix, limit, got, want in (("", bound.out, fast[0], reference[0]), ("d", bound.grad, fast[1], reference[1])):
        for name in sorted(got.keys() | want.keys()):
            a, b = got.get(name), want.get(name)
            if a is None and b is None:
                continue
            if a is None or b is None or a.shape != b.shape:
                errors[prefix + name] = (math.inf, math.inf, limit)
                continue
            a, b = a.detach().double(), b.detach().double()
            diff, scale = (a - b).norm().item(), b.norm().item()
            relative = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
            errors[prefix + name] = (relative, (a - b).abs().max().item() if a.numel() else 0.0, limit)
    return errors


def _message(name, device, shape_class, dtype, errors) -> str:
    figures = "; ".join(f"{tensor}: relative error {rel:.1e} (bound {limit:.0e}), max abs error {abs_:.1e}"
                        for tensor, (rel, abs_, limit) in errors.items() if not rel <= limit)
    return (f"{name}: the fast kernel disagrees with the torch code on {device} ({dtype}, {shape_class}) on a small "
            f"seeded input: {figures}. The torch code runs these calls from now on ({ENV}=0 skips the check).")


# ----------------------------------------------------------------------------------------------------------------------
# small seeded inputs, for the dispatch points' make_inputs


def normal(g: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """scale * N(0, 1) on the generator's device, drawn in float32 and cast to `dtype`."""
    return (scale * torch.randn(*shape, generator=g, device=g.device)).to(dtype)


def unit(g: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """Random vectors of unit length along the last axis (keys and queries as the mixers give them)."""
    return torch.nn.functional.normalize(torch.randn(*shape, generator=g, device=g.device), dim=-1).to(dtype)


def log_decay(g: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """log sigmoid(N(0, 1) + 3): decays near 0.95, as the mixers start."""
    return torch.nn.functional.logsigmoid(torch.randn(*shape, generator=g, device=g.device) + 3).to(dtype)


def resets(B: int, T: int, device) -> torch.Tensor:
    """[B, T] bool: a reset at the first step of row 0, a one-token document, and one past the middle."""
    reset = torch.zeros(B, T, dtype=torch.bool, device=device)
    reset[0, [0, T // 3, T // 3 + 1]] = True
    reset[:, T // 2 + 1] = True
    return reset

"""An elementwise (diagonal) linear recurrence, the scan behind Hawk's RG-LRU and HGRN:

    h_t = exp(log_a_t) * h_{t-1} + x_t,    x, log_a: [B, T, D],    state h: [B, D]

`diagonal_scan` is the chunkwise form for training, `diagonal_scan_recurrent` the plain per-step loop, for decoding.
Both keep the arithmetic in float32 (float64 stays float64) and return h in the input dtype. Both take `reset`
[B, T] bool: where True, h_{t-1} := 0 before step t (a document starts), i.e. a decay of exactly 0 there.

Why a loop over the positions of a chunk rather than a [C, C, D] decay matrix: the matrix form (exp(b_t - b_s) for
s <= t, -inf above the diagonal, then a weighted sum) does C times the elementwise work and holds C times the
memory of the input for the backward, and was many times slower on CPU. The scan has no matrix product to batch
into, so the loop over C positions, each step one fused multiply-add over all chunks at once ([B, N, D]), moves the
same bytes as the plain loop in T / C times fewer steps. On CPU a per-step loop written with unbind (as
`diagonal_scan_recurrent` is) is already bound by memory traffic when its steps are large, so there the chunkwise
form gains little or nothing (docs/performance-history.md, "Sequence ops"); its few, large steps are for a GPU
without fla, where kernel launches bound a per-step loop.
"""

import torch

from lm.ops import self_check
from lm.ops.common import (
    autocast_off,
    check_reset,
    compute_dtype,
    effective_chunk_size,
    keep_state,
    pad_to_chunks,
    split_chunks,
)
from lm.ops.fla import CHECK_T, fla_agrees, fla_diagonal_scan, use_fla


def diagonal_scan(
    x: torch.Tensor,
    log_a: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise diagonal scan h_t = exp(log_a_t) * h_{t-1} + x_t.

    x, log_a: [B, T, D]; initial_state: [B, D] or None (zeros); reset: [B, T] bool or None (True: h_{t-1} := 0).
    Any T works. Returns (h [B, T, D] in x's dtype, final_state [B, D] in float32, or float64 for float64 inputs).
    backend: "torch" (this code), "fla" (flash-linear-attention's fused_recurrent_hgrn, CUDA only; with resets its
    variable-length form) or "auto" (fla for CUDA bf16/fp16 inputs when it imports, else torch).
    """
    _check_shapes(x, log_a, initial_state, reset)
    if use_fla(backend, x, log_a, initial_state, op="diagonal_scan") and _fla_agrees(x, log_a, initial_state, reset):
        return fla_diagonal_scan(x, log_a, initial_state, reset)
    state = _initial_state(initial_state, x)
    keep = None if reset is None else keep_state(reset, state.dtype)[..., None]
    h, state = _chunkwise(x, log_a, keep, state, chunk_size)
    return h.to(x.dtype), state


def _fla_agrees(x, log_a, initial_state, reset) -> bool:
    """fla's self-check for this call's shape class (lm.ops.fla.fla_agrees): the dtypes, the width, an initial state
    and resets or not; the input is as tests/test_ops_gpu.py's (as fla's own hgrn test builds it), smaller."""
    D = x.shape[-1]
    dtypes = tuple(None if t is None else t.dtype for t in (x, log_a, initial_state))
    shape_class = (dtypes, D, reset is not None)

    def make_inputs(g):
        B, T = 1, CHECK_T
        gate = self_check.normal(g, B, T, D)
        return dict(
            x=((1 - gate.sigmoid()) * self_check.normal(g, B, T, D)).to(x.dtype).requires_grad_(),
            log_a=torch.nn.functional.logsigmoid(gate).to(log_a.dtype).requires_grad_(),
            initial_state=None if initial_state is None else self_check.normal(g, B, D, dtype=initial_state.dtype)
            .requires_grad_(),
            reset=None if reset is None else self_check.resets(B, T, x.device),
        )

    def run(backend):
        def call(**inputs):
            out, state = diagonal_scan(**inputs, backend=backend)
            return dict(out=out, state=state)

        return call

    return fla_agrees("diagonal_scan", "fused_recurrent_hgrn", run, make_inputs, x, shape_class)


@autocast_off()
def _chunkwise(x, log_a, keep, state, chunk_size):
    """The chunkwise algorithm, in the compute dtype of `state`.

    Within each chunk, the scan from a zero state runs for all chunks at once (a loop over the C positions). With b_t
    the cumulative log-decay from the chunk's start to t (b_t <= 0 for decays <= 1, so exp(b_t) never overflows) and
    H_{n-1} the state entering chunk n:
        h_t = local_t + exp(b_t) * H_{n-1},    H_n = exp(b_last) * H_{n-1} + local_last.
    The second line is itself a diagonal scan, over the N chunks, so it is done by this same function: the levels
    shrink T by C each, a few Python steps in all. The padded tail (x = 0, log-decay 0) leaves the state unchanged.
    keep ([B, T, 1], 0 at a reset, or None) multiplies the decay after the exponential (no log 0), and exp(b_t) by
    its running product (no reset since the chunk's start); a chunk with a reset passes 0 on to the level above.
    """
    T, dtype = x.shape[1], state.dtype
    chunk_size = effective_chunk_size(chunk_size, T)
    x, log_a = (pad_to_chunks(t.to(dtype), chunk_size) for t in (x, log_a))
    keep = None if keep is None else pad_to_chunks(keep, chunk_size, value=1.0)
    if T <= chunk_size or chunk_size == 1:  # one chunk (or chunks of one step): the loop is the whole answer
        return _loop(x, log_a, keep, state, dim=1)
    x, log_a = split_chunks(x, chunk_size), split_chunks(log_a, chunk_size)  # [B, N, C, D]
    keep = None if keep is None else split_chunks(keep, chunk_size)  # [B, N, C, 1]
    local, _ = _loop(x, log_a, keep, torch.zeros_like(x[:, :, 0]), dim=2)  # each chunk from a zero state
    b = log_a.cumsum(2)  # [B, N, C, D]
    from_start = b.exp() if keep is None else b.exp() * keep.cumprod(2)  # every exponent <= 0
    chunk_keep = None if keep is None else keep.prod(2)  # [B, N, 1]
    ends, final = _chunkwise(local[:, :, -1], b[:, :, -1], chunk_keep, state, chunk_size)  # H_n: [B, N, D]
    entering = torch.cat([state[:, None], ends[:, :-1]], dim=1)  # H_{n-1}
    h = torch.addcmul(local, from_start, entering[:, :, None])
    return h.flatten(1, 2)[:, :T], final


def _loop(x, log_a, keep, h, dim):
    """h_t = exp(log_a_t) * keep_t * h_{t-1} + x_t along `dim`, one fused multiply-add per step. unbind rather than
    indexing: the backward of T slices x[:, t] would write T full-size zero-padded gradients (quadratic in T)."""
    a = log_a.exp() if keep is None else log_a.exp() * keep
    outs = []
    for x_t, a_t in zip(x.unbind(dim), a.unbind(dim)):
        h = torch.addcmul(x_t, a_t, h)
        outs.append(h)
    return torch.stack(outs, dim), h


@autocast_off()
def diagonal_scan_recurrent(
    x: torch.Tensor, log_a: torch.Tensor, *, initial_state: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent diagonal scan: a plain loop over t, for decoding (T=1 with a carried state) and as a readable
    statement of the recurrence. Same arguments and results as `diagonal_scan`."""
    _check_shapes(x, log_a, initial_state, reset)
    state = _initial_state(initial_state, x)
    keep = None if reset is None else keep_state(reset, state.dtype)[..., None]
    h, state = _loop(x.to(state.dtype), log_a.to(state.dtype), keep, state, dim=1)
    return h.to(x.dtype), state


def _initial_state(initial_state: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The state to start from in the compute dtype: the given one, or zeros [B, D]."""
    dtype = compute_dtype(x)
    if initial_state is not None:
        return initial_state.to(dtype)
    return x.new_zeros(x.shape[0], x.shape[2], dtype=dtype)


def _check_shapes(x, log_a, initial_state, reset) -> None:
    if x.dim() != 3 or log_a.shape != x.shape:
        raise ValueError(f"expected x and log_a [B, T, D], got {tuple(x.shape)} and {tuple(log_a.shape)}")
    check_reset(reset, x.shape[0], x.shape[1])
    if initial_state is not None and initial_state.shape != (x.shape[0], x.shape[2]):
        raise ValueError(
            f"expected initial_state [B, D] = {(x.shape[0], x.shape[2])}, got {tuple(initial_state.shape)}"
        )

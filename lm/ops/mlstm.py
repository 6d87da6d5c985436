"""The mLSTM of xLSTM 7B: a matrix memory with an exponential input gate and a sigmoid forget gate.

Unstabilised, with q^ = q / sqrt(K), f_t = sigmoid(f_pre_t) and i_t = exp(i_pre_t):

    C_t = f_t C_{t-1} + i_t k_t v_t^T          [K, V]
    n_t = f_t n_{t-1} + i_t k_t                [K]
    h_t = C_t^T q^_t / max(|n_t^T q^_t|, 1)

exp(i_pre) overflows quickly, so the state is kept stabilised by a running maximum of log-gates,

    m_t = max(log f_t + m_{t-1}, i_pre_t),     C~_t = C_t exp(-m_t),     n~_t = n_t exp(-m_t),

and h_t = C~_t^T q^_t / (max(|n~_t^T q^_t|, exp(-m_t)) + eps). With eps = 0 this equals the unstabilised h_t; eps > 0
(the xLSTM convention) guards the division. The state is (C~ [B, H, K, V], n~ [B, H, K], m [B, H]); it stands for
the unstabilised C = C~ exp(m), n = n~ exp(m). The zero state is (0, 0, 0).

reset ([B, T] bool, optional) packs several documents in a row: where True, the state is set to the zero state,
m included, before that token's update, so each document computes exactly what it would alone (the first one
continuing the initial state), its stabiliser and hence the eps-guarded denominator included.

m is only a stabiliser: with eps = 0 the outputs and the represented C, n do not depend on the value chosen for it,
so every stabiliser the ops compute is detached from autograd (the gradient is then exact for eps = 0 and off by
O(eps) otherwise, and no gradient has to flow through max()). An initial state's m is a real input and keeps its
gradient.

`mlstm` is the chunkwise form (training), `mlstm_recurrent` the per-step loop (decoding). Both compute in float32
(float64 stays float64) and return the output in the input dtype and the state in the compute dtype.
"""

import functools
import math

import torch
import torch.nn.functional as F

from lm.ops import self_check
from lm.ops.common import (
    autocast_off,
    check_shapes,
    compute_dtype,
    effective_chunk_size,
    from_head_chunks,
    pad_to_chunks,
    split_chunks,
    to_head_chunks,
    warn_once,
)
from lm.ops.kernel_packages import import_kernels

MLSTMState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (C~ [B, H, K, V], n~ [B, H, K], m [B, H])

BACKENDS = ("auto", "torch", "mlstm_kernels")


def mlstm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i_pre: torch.Tensor,
    f_pre: torch.Tensor,
    *,
    eps: float = 1e-6,
    initial_state: MLSTMState | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MLSTMState]:
    """Chunkwise mLSTM.

    q, k: [B, T, H, K]; v: [B, T, H, V]; i_pre, f_pre: [B, T, H] gate pre-activations; initial_state: (C~, n~, m) or
    None (zeros). Any T works. Returns (out [B, T, H, V] in q's dtype, final (C~, n~, m) in float32, or float64 for
    float64 inputs).
    backend: "torch" (this code), "mlstm_kernels" (that package's "chunkwise--triton_xl_chunk" Triton kernel, CUDA
    only; see `_kernel_unusable_reason` for its limits) or "auto" (torch: the kernel's gradients did not match this
    code's on the one GPU it ran on, so it runs only by name).
    reset: [B, T] bool or None; where True the state is cleared to the zero state (0, 0, 0) before that token's
    update (document boundaries in a packed row). The kernel has no varlen support.
    """
    _check_inputs(q, k, v, i_pre, f_pre, initial_state, reset)
    torch_chunk_size = effective_chunk_size(chunk_size, q.shape[1])  # the kernel takes the asked-for size
    if _use_mlstm_kernels(backend, q, k, v, initial_state, chunk_size, reset) \
            and _kernel_agrees(q, k, v, i_pre, f_pre, eps, initial_state, chunk_size):
        return _mlstm_kernels_chunkwise(q, k, v, i_pre, f_pre, eps, initial_state, chunk_size)
    return _chunkwise(q, k, v, i_pre, f_pre, eps, initial_state, torch_chunk_size, reset)


@autocast_off()
def mlstm_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i_pre: torch.Tensor,
    f_pre: torch.Tensor,
    *,
    eps: float = 1e-6,
    initial_state: MLSTMState | None = None,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MLSTMState]:
    """Recurrent mLSTM: the stabilised step loop, for decoding (T=1 with a carried state). Same arguments and results
    as `mlstm`."""
    _check_inputs(q, k, v, i_pre, f_pre, initial_state, reset)
    in_dtype, dtype = q.dtype, compute_dtype(q)
    q = q.to(dtype) / math.sqrt(q.shape[-1])
    k, v, i_pre = k.to(dtype), v.to(dtype), i_pre.to(dtype)
    log_f = F.logsigmoid(f_pre.to(dtype))  # never log(sigmoid(.)): that is -inf below about -88 in float32
    C, n, m = _initial_state(initial_state, q, v.shape[-1], dtype)
    outs = []
    resets = [None] * q.shape[1] if reset is None else reset[..., None].unbind(1)  # [B, 1] per step
    # unbind rather than x[:, t]: the backward of T slices would write T full-size gradients.
    for q_t, k_t, v_t, i_t, log_f_t, r in zip(*(x.unbind(1) for x in (q, k, v, i_pre, log_f)), resets):
        if r is not None:  # back to the zero state, m included, so the stabiliser is the lone document's
            C, n, m = torch.where(r[..., None, None], 0.0, C), torch.where(r[..., None], 0.0, n), torch.where(r, 0.0, m)
        m_new = torch.maximum(log_f_t + m, i_t).detach()  # [B, H]
        forget = torch.exp(log_f_t + m - m_new)[..., None]  # <= 1
        write = torch.exp(i_t - m_new)[..., None]  # <= 1
        C = forget[..., None] * C + torch.einsum("bhk,bhv->bhkv", write * k_t, v_t)
        n = forget * n + write * k_t
        num = torch.einsum("bhkv,bhk->bhv", C, q_t)
        den = torch.einsum("bhk,bhk->bh", n, q_t)
        outs.append(num / _denominator(den, m_new, eps)[..., None])
        m = m_new
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)  # T = 0: nothing to do
    return out.to(in_dtype), (C, n, m)


# ----------------------------------------------------------------------------------------------------------------------
# torch chunkwise form


@autocast_off()
def _chunkwise(q, k, v, i_pre, f_pre, eps, initial_state, chunk_size, reset=None):
    """The chunkwise algorithm: all intra-chunk work is batched over chunks; only the state pass loops over them.

    Inside a chunk (steps 0..L-1, entered with state (C~p, n~p, m_p)), with cumulative log forget gates
    b_i = sum_{l<=i} log f_l, the log-weight of step j's write as seen from step i >= j is
    D_ij = b_i - b_j + i_pre_j (formed as segment sums, see `_segment_sums`), and of the entering state b_i + m_p.
    With the row stabiliser
    m_i = max(max_j D_ij, b_i + m_p) (the recurrent m_i, unrolled):
        num_i = sum_j exp(D_ij - m_i) (q^_i . k_j) v_j + exp(b_i + m_p - m_i) C~p^T q^_i
        den_i = sum_j exp(D_ij - m_i) (q^_i . k_j)     + exp(b_i + m_p - m_i) n~p . q^_i
        h_i   = num_i / (max(|den_i|, exp(-m_i)) + eps)
    All exponents are <= 0 by construction, so nothing overflows.

    Resets split a chunk into segments (see `_segments`): a write reaches only rows of its own segment, and rows after
    a reset in the chunk see, instead of the entering state, the zero state placed before the reset: nothing in C~, n~,
    but the log-weight (sum of log f over the segment up to i) + 0 in m_i, as the recurrent m does after a reset.
    """
    T, V, in_dtype, dtype = q.shape[1], v.shape[-1], q.dtype, compute_dtype(q)
    state = _initial_state(initial_state, q, V, dtype)
    if T == 0:
        return v.new_zeros(v.shape, dtype=in_dtype), state
    q = to_head_chunks(q, chunk_size, dtype) / math.sqrt(q.shape[-1])  # [B, H, N, L, K]
    k, v = to_head_chunks(k, chunk_size, dtype), to_head_chunks(v, chunk_size, dtype)
    # Padded tail steps must leave the state alone: log f = 0 (no decay) and i_pre = -inf (no write, and no effect on
    # the running max m). Their keys are zero as well.
    log_f = to_head_chunks(F.logsigmoid(f_pre.to(dtype)), chunk_size, dtype)  # [B, H, N, L]
    i_pre = split_chunks(pad_to_chunks(i_pre.to(dtype), chunk_size, value=-math.inf).transpose(1, 2), chunk_size, 2)

    b = log_f.cumsum(-1)  # [B, H, N, L]
    log_d = _segment_sums(log_f) + i_pre[..., None, :]  # D_ij: [B, H, N, L, L], -inf above the diagonal
    enter = None  # without resets the entering state reaches every row
    if reset is not None:
        b, log_d, enter = _segments(log_f, b, log_d, reset, chunk_size)

    C_start, n_start, m_start, final_state = _chunk_states(k, v, b, log_d, state, enter)
    out = _chunk_outputs(q, k, v, b, log_d, C_start, n_start, m_start, eps, enter)
    return from_head_chunks(out, T).to(in_dtype), final_state


def _segment_sums(log_f: torch.Tensor) -> torch.Tensor:
    """S[..., i, j] = sum_{l=j+1..i} log_f[..., l] for j <= i (0 on the diagonal), -inf above it.

    Each entry is summed on its own instead of as b_i - b_j, which would cancel catastrophically in float32 once the
    chunk's cumulative log-decay is large (a forget pre-activation of -1e3 makes b ~ -1e3 per step)."""
    L = log_f.shape[-1]
    ones = torch.ones(L, L, dtype=torch.bool, device=log_f.device)
    x = log_f[..., :, None].expand(*log_f.shape, L)  # x[..., l, j] = log_f[l]
    x = x.masked_fill(~ones.tril(-1), 0.0)  # keep l > j
    return x.cumsum(-2).masked_fill(~ones.tril(), -math.inf)


def _segments(log_f, b, log_d, reset, chunk_size):
    """Cut the chunks at the resets: seg_i = number of resets at steps <= i of the chunk (the padded tail has none).

    Returns log_d with D_ij = -inf unless seg_j == seg_i; b replaced, in rows with seg_i > 0, by the sum of log f over
    the segment's steps <= i (the log-weight of the zero state met at the reset, whose m is 0); and enter = (seg == 0)
    [B, 1, N, L], the rows the entering state reaches. Segment sums are masked sums, not differences of b (see
    `_segment_sums`); rows with seg_i == 0 keep b exactly, so an all-False reset computes what reset=None does.
    """
    L = log_f.shape[-1]
    r = pad_to_chunks(reset.to(device=log_f.device, dtype=torch.long), chunk_size)
    seg = split_chunks(r, chunk_size).cumsum(-1)[:, None]  # [B, 1, N, L], broadcast over heads
    same = seg[..., :, None] == seg[..., None, :]  # [B, 1, N, L, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=log_f.device).tril()
    x = log_f[..., None, :].expand(*log_f.shape[:-1], L, L)  # x[..., i, l] = log_f[l]
    seg_sum = x.masked_fill(~(same & causal), 0.0).sum(-1)
    enter = seg == 0
    return torch.where(enter, b, seg_sum), log_d.masked_fill(~same, -math.inf), enter


def _chunk_states(k, v, b, log_d, state, enter=None):
    """The state entering every chunk, and the final state.

    A chunk moves the state (C~p, n~p, m_p) to
        m_new = max(g + m_p, max_j a_j),    a_j = D_{L-1, j} (log-weight of step j's write at the chunk's end)
        C~new = exp(g + m_p - m_new) C~p + sum_j exp(a_j - m_new) k_j v_j^T      (n~ likewise with k_j)
    with g = b_{L-1} the chunk's total log forget gate. The stabilisers are found first (a cheap loop over [B, H]
    scalars); then all chunks' writes are one batched einsum and only the decay-and-add loops over chunks.
    A chunk with a reset (enter False at its end) drops the entering state: m_p counts as 0 (the zero state's), g is
    the last segment's log-weight (see `_segments`) and C~p, n~p get the factor 0.
    Returns C_start [B, H, N, K, V], n_start [B, H, N, K], m_start [B, H, N] and the final (C~, n~, m).
    """
    C, n, m0 = state
    g = b[..., -1]  # [B, H, N]
    a = log_d[..., -1, :]  # [B, H, N, L]
    carry = None if enter is None else enter[..., -1]  # [B, 1, N]: no reset in the chunk
    with torch.no_grad():
        a_max, g_ = a.amax(-1), g.detach()
        m, m_ends = m0.detach(), []
        for c in range(g.shape[-1]):
            m_in = m if carry is None else torch.where(carry[..., c], m, 0.0)
            m = torch.maximum(g_[..., c] + m_in, a_max[..., c])
            m_ends.append(m)
        m_end = torch.stack(m_ends, dim=-1)  # [B, H, N]
    # m0 keeps its gradient: as part of the initial state it scales what the state stands for (C = C~ exp(m)).
    m_start = torch.cat([m0[..., None], m_end[..., :-1]], dim=-1)
    if carry is None:
        decay = torch.exp(g + m_start - m_end)  # [B, H, N], <= 1
    else:  # where a reset drops C~p, m_end >= g + 0: the unused branch stays <= 1 (no inf meets the zero gradient)
        decay = torch.where(carry, torch.exp(g + torch.where(carry, m_start, 0.0) - m_end), 0.0)
    k_to_end = k * torch.exp(a - m_end[..., None])[..., None]  # [B, H, N, L, K]
    C_writes = torch.einsum("bhnlk,bhnlv->bhnkv", k_to_end, v)
    n_writes = k_to_end.sum(-2)
    C_start, n_start = [], []
    for c in range(g.shape[-1]):
        C_start.append(C)
        n_start.append(n)
        C = decay[..., c, None, None] * C + C_writes[:, :, c]
        n = decay[..., c, None] * n + n_writes[:, :, c]
    return torch.stack(C_start, dim=2), torch.stack(n_start, dim=2), m_start, (C, n, m_end[..., -1])


def _chunk_outputs(q, k, v, b, log_d, C_start, n_start, m_start, eps, enter=None):
    """Outputs of all chunks at once, intra-chunk (masked, gated q k^T) plus the entering state: [B, H, N, L, V].

    Rows past a reset (enter False) take the zero state's m = 0 in place of m_start and nothing from C~p, n~p."""
    m_in = m_start[..., None] if enter is None else torch.where(enter, m_start[..., None], 0.0)
    log_inter = b + m_in  # [B, H, N, L], log-weight of the entering state at step i
    with torch.no_grad():
        m = torch.maximum(log_d.amax(-1), log_inter)  # row stabiliser m_i
    gated = torch.einsum("bhnik,bhnjk->bhnij", q, k) * torch.exp(log_d - m[..., None])
    inter = torch.exp(log_inter - m)  # <= 1
    if enter is not None:
        inter = torch.where(enter, inter, 0.0)
    num = gated @ v + inter[..., None] * torch.einsum("bhnik,bhnkv->bhniv", q, C_start)
    den = gated.sum(-1) + inter * torch.einsum("bhnik,bhnk->bhni", q, n_start)
    return num / _denominator(den, m, eps)[..., None]


def _denominator(den: torch.Tensor, m: torch.Tensor, eps: float) -> torch.Tensor:
    """max(|n~^T q^|, exp(-m)) + eps, i.e. exp(-m) (max(|n^T q^|, 1) + eps exp(m)) in unstabilised terms."""
    return torch.maximum(den.abs(), torch.exp(-m)) + eps


def _check_inputs(q, k, v, i_pre, f_pre, initial_state, reset=None) -> None:
    """Contract shapes: q, k [B, T, H, K], v [B, T, H, V], gates [B, T, H], state (C~, n~, m) or None, reset [B, T]
    bool or None."""
    check_shapes(q, k, v, None, reset=reset, i_pre=i_pre, f_pre=f_pre)
    if initial_state is None:
        return
    B, _, H, K = q.shape
    expected = ((B, H, K, v.shape[-1]), (B, H, K), (B, H))
    if len(initial_state) != 3 or any(tuple(s.shape) != e for s, e in zip(initial_state, expected)):
        got = [tuple(s.shape) for s in initial_state]
        raise ValueError(f"expected initial_state (C~, n~, m) with shapes {expected}, got {got}")


def _initial_state(initial_state, q, V, dtype) -> MLSTMState:
    """The state to start from in the compute dtype: the given (C~, n~, m), or zeros for q [B, *, H, K]."""
    if initial_state is not None:
        return tuple(s.to(dtype) for s in initial_state)
    B, _, H, K = q.shape
    return q.new_zeros(B, H, K, V, dtype=dtype), q.new_zeros(B, H, K, dtype=dtype), q.new_zeros(B, H, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------------
# optional mlstm_kernels (Triton) backend


def _use_mlstm_kernels(backend, q, k, v, initial_state, chunk_size, reset=None) -> bool:
    """Resolve `backend`: True to call mlstm_kernels, False for the torch code. "mlstm_kernels" raises if it cannot."""
    if backend not in BACKENDS:
        raise ValueError(f"mlstm: backend must be one of {BACKENDS}, got {backend!r}")
    # "auto" is the torch code too: the kernel's backward treats the normaliser max(|n . q^|, exp(-m)) as a constant,
    # so its dq, dk, di and df are not the layer's (lm/bench/mlstm_kernels_grad.py; on the lent H200 dq was off by a
    # relative RMS error of 1.04). It runs only when asked for by name.
    if backend != "mlstm_kernels":
        if backend == "auto" and q.is_cuda:
            say_torch_code_on_cuda()
        return False
    reason = _kernel_unusable_reason(q, k, v, initial_state, chunk_size, reset)
    if reason is not None:
        raise RuntimeError(f"mlstm: backend='mlstm_kernels' cannot run this call: {reason}; use backend='torch'")
    return True


def say_torch_code_on_cuda() -> None:
    """The notice, once, that "auto" runs mLSTM's torch code on CUDA, and why."""
    warn_once("mlstm: the torch code runs on CUDA, not mlstm_kernels' kernel: the kernel's backward treats the "
              "normaliser as a constant (lm/bench/mlstm_kernels_grad.py); backend='mlstm_kernels' runs it by name, "
              "with those gradients.")


def _kernel_unusable_reason(q, k, v, initial_state, chunk_size, reset=None) -> str | None:
    """Why mlstm_kernels' chunkwise--triton_xl_chunk (checked against mlstm_kernels 2.0.6) cannot take this call.

    Its limits: CUDA; float32/bf16/fp16; T a multiple of 16, and either T in {16, 32, 64} (it then uses T as the
    chunk) or the chunk a power of two dividing T; head dims for tensor-core tiles (multiples of 16 here, to be safe).
    Its backward returns zero gradients for the initial n~ and m, so initial states that need gradients stay on torch.
    It has no varlen support, so calls with a reset stay on torch.
    Its gradients are those of the layer with the normaliser max(|n~ . q^|, exp(-m)) held constant
    (lm/bench/mlstm_kernels_grad.py), so dq, dk, di and df differ from the torch code's.
    Other known differences from the torch code (not checked here): it takes log(sigmoid(f_pre)), which is -inf
    below about -88 in float32; it forms the chunk's state update k^T v in the input dtype; its backward ignores
    gradients flowing into the final n~ and m; and its float32 matmuls may use TF32.
    """
    T, K, V = q.shape[1], q.shape[-1], v.shape[-1]
    if reset is not None:
        return "it has no reset / varlen support"
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return "it needs CUDA tensors"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"it does not support {q.dtype}"
    if T == 0 or T % 16 or (T >= 128 and (chunk_size & (chunk_size - 1) or chunk_size < 16 or T % chunk_size)):
        return f"T={T} must be a multiple of 16 and of chunk_size={chunk_size} (a power of two >= 16)"
    if T < 128 and T & (T - 1):
        return f"T={T} below 128 must be a power of two"
    if K % 16 or V % 16:
        return f"head dims K={K}, V={V} must be multiples of 16"
    if initial_state is not None and any(s.requires_grad for s in initial_state):
        return "its backward gives no gradient for the initial n~ and m"
    if _mlstm_kernels_chunkwise_fn() is None:
        return "mlstm_kernels (with Triton) is not importable"
    return None


def _kernel_agrees(q, k, v, i_pre, f_pre, eps, initial_state, chunk_size) -> bool:
    """The kernel's self-check (lm.ops.self_check; it runs only by name, so that is where it is checked), as
    tests/test_ops_gpu_mlstm.py compares it, smaller: the output, the final states and the gradients of k, v and the
    gates (not dq, which is known to differ: `_kernel_unusable_reason`). The shape class: the dtypes, the head sizes,
    the kernel's chunking (a short T is one chunk of T, a long one chunks of chunk_size), an initial state or not."""
    T, K, V = q.shape[1], q.shape[-1], v.shape[-1]
    check_T = T if T < 128 else max(128, 2 * chunk_size)  # the kernel takes T in {16, 32, 64} or multiples of chunks
    dtypes = tuple(t.dtype for t in (q, k, v, i_pre, f_pre))
    shape_class = (dtypes, K, V, T if T < 128 else f"chunks of {chunk_size}", initial_state is not None, eps)

    def make_inputs(g):
        B, H = 1, 2
        x = dict(
            q=self_check.normal(g, B, check_T, H, K, dtype=q.dtype),  # dq is not compared
            k=self_check.normal(g, B, check_T, H, K, dtype=k.dtype).requires_grad_(),
            v=self_check.normal(g, B, check_T, H, V, dtype=v.dtype).requires_grad_(),
            i_pre=self_check.normal(g, B, check_T, H, scale=2.0, dtype=i_pre.dtype).requires_grad_(),
            f_pre=(2 + self_check.normal(g, B, check_T, H, scale=1.5)).to(f_pre.dtype).requires_grad_(),
        )
        if initial_state is not None:  # the kernel takes no gradient for it
            x["state"] = (self_check.normal(g, B, H, K, V), self_check.normal(g, B, H, K).abs(),
                          self_check.normal(g, B, H))
        return x

    def run(backend):
        def call(state=None, **x):
            out, (C, n, m) = mlstm(**x, eps=eps, initial_state=state, chunk_size=chunk_size, backend=backend)
            # Only the output is differentiated: the kernel's backward ignores gradients into the final n~ and m.
            return dict(out=out, C=C.detach(), n=n.detach(), m=m.detach())

        return call

    return self_check.checked("mlstm (mlstm_kernels chunkwise--triton_xl_chunk)", q.device, shape_class,
                              run("mlstm_kernels"), run("torch"), make_inputs, q.dtype, bounds="mlstm_kernels")


@functools.cache
def _mlstm_kernels_chunkwise_fn():
    """mlstm_kernels' chunkwise Triton kernel, or None when the package is not installed; cached, since a failed
    import is slow to retry. An installed package that fails to load raises on a machine with CUDA
    (lm.ops.kernel_packages)."""

    def load():
        from mlstm_kernels.torch import get_mlstm_kernel

        return get_mlstm_kernel("chunkwise--triton_xl_chunk")

    return import_kernels(load)


def _mlstm_kernels_chunkwise(q, k, v, i_pre, f_pre, eps, initial_state, chunk_size):
    """`mlstm` through mlstm_kernels (layout [B, H, T, *], m as [B, H, 1]).

    Same conventions as ours: qk_scale defaults to K**-0.5 (it cannot be passed), denominator
    max(|n~ . q^|, exp(-m)) + eps, zero state (0, 0, 0), states returned in float32. Autocast is switched off around
    the call because its autograd Function would otherwise cast every input, gates and state included, to
    `autocast_kernel_dtype`; the gates and state are passed in float32 and the kernel upcasts q, k, v itself.
    """
    heads_first = lambda x: x.transpose(1, 2).contiguous()  # [B, T, H, *] -> [B, H, T, *]
    C0 = n0 = m0 = None
    if initial_state is not None:
        C0, n0, m0 = (s.float().contiguous() for s in initial_state)
        m0 = m0[..., None]
    with torch.autocast("cuda", enabled=False):
        out, (C, n, m) = _mlstm_kernels_chunkwise_fn()(
            q=heads_first(q), k=heads_first(k), v=heads_first(v.to(q.dtype)),
            i=heads_first(i_pre.float()), f=heads_first(f_pre.float()),
            c_initial=C0, n_initial=n0, m_initial=m0,
            return_last_states=True, eps=eps, chunk_size=chunk_size, autocast_kernel_dtype=q.dtype,
        )  # fmt: skip
    return out.transpose(1, 2).to(q.dtype), (C.float(), n.float(), m.float().reshape(m.shape[:2]))

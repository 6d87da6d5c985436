"""Small helpers shared by the chunkwise ops: dtype policy, padding T to a multiple of the chunk size, chunking, and
the notice of a slow fallback."""

import contextlib
import functools
import warnings

import torch
import torch.nn.functional as F


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype state and decay arithmetic runs in: float64 stays float64, everything else is float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def autocast_off():
    """Run the enclosed code (or decorated function) with autocast off on every device where it is on.

    The ops cast their inputs to `compute_dtype` once and must then stay there: under autocast (Lightning's
    bf16-mixed) every matmul and einsum would otherwise be recast to bf16, and Mesa's CG, the decays and the carried
    states would lose what the float32 cast was for. Works as a decorator too (checked at each call)."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def effective_chunk_size(chunk_size: int, T: int) -> int:
    """The chunk length to use for a sequence of T steps: a short sequence is one chunk rather than a padded one."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return min(chunk_size, max(1, T))


def pad_to_chunks(x: torch.Tensor, chunk_size: int, dim: int = 1, value: float = 0.0) -> torch.Tensor:
    """Pad `x` along `dim` (the time axis) with `value` so its length is a multiple of `chunk_size`.

    Padding with zero keys/values and zero log-decay is harmless for a causal op: padded steps come after every real
    step, add nothing to the state (k = v = 0 or beta = 0) and do not decay it (log-decay 0), so the real outputs and
    the final state are unchanged; callers slice the padded outputs off.
    """
    T = x.shape[dim]
    pad = (-T) % chunk_size
    if pad == 0:
        return x
    dim = dim % x.dim()
    # F.pad lists (left, right) pairs starting from the last dimension.
    widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
    return F.pad(x, widths, value=value)


def split_chunks(x: torch.Tensor, chunk_size: int, dim: int = 1) -> torch.Tensor:
    """Reshape the time axis `dim` of length N*C into two axes (N, C); T must already be a multiple of chunk_size."""
    dim = dim % x.dim()
    T = x.shape[dim]
    if T % chunk_size:
        raise ValueError(f"time length {T} is not a multiple of chunk_size {chunk_size}; pad_to_chunks first")
    return x.unflatten(dim, (T // chunk_size, chunk_size))


def to_head_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, *] -> [B, H, N, C, *] in `dtype`, zero-padding T up to a multiple of C = chunk_size.

    Heads go before chunks so each (batch, head) pair is one contiguous batch of small matmuls. The result is
    copied into that layout once: a transposed view would be copied again by every matmul that reads it (the
    Mesa solve reads k twice per CG step).
    """
    x = pad_to_chunks(x.to(dtype), chunk_size, dim=1)
    return split_chunks(x.transpose(1, 2), chunk_size, dim=2).contiguous()


def from_head_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of `to_head_chunks`: [B, H, N, C, *] -> [B, T, H, *], dropping the padded steps."""
    return x.flatten(2, 3)[:, :, :T].transpose(1, 2)


def causal_decay(b: torch.Tensor, documents: "ChunkDocuments | None" = None) -> torch.Tensor:
    """Decay matrix D[..., i, j] = exp(b_i - b_j) for i >= j and 0 above the diagonal, from cumulative log-decays b.

    The difference is formed before exponentiating, so a long chunk with strong decay neither overflows nor
    underflows to 0/0; the upper triangle is set to -inf before exp (its differences can be huge and positive, and an
    inf there would turn into NaN in the backward pass). With `documents`, D is also 0 between steps of different
    documents (a reset between them), set the same way.
    """
    C = b.shape[-1]
    diff = b[..., :, None] - b[..., None, :]
    allowed = torch.ones(C, C, dtype=torch.bool, device=b.device).tril()
    if documents is not None:
        allowed = allowed & documents.same
    return diff.masked_fill(~allowed, float("-inf")).exp()


class ChunkDocuments:
    """Where the documents of a packed row start, in the chunked layout, as the masks the chunkwise forms need.

    A reset at step t clears the state before t's update, which is a zero decay at t. A zero decay cannot go through
    the log-space cumulative sums (log 0 = -inf, and -inf - -inf = NaN), so the decays stay as they are and every
    product of decays that spans a reset is multiplied by 0 instead, with these masks. With seg_i the number of resets
    in step i's chunk up to and including i ([B, 1, N, C]; 1 broadcasts over heads):
        same       [B, 1, N, C, C]  steps i and j are in one document (seg_i == seg_j): j's write reaches i
        from_start [B, 1, N, C]     no reset from the chunk's start to i (seg_i == 0): the entering state reaches i
        to_end     [B, 1, N, C]     no reset after j in its chunk (seg_j == seg_last): j's write reaches the chunk end
        whole      [B, 1, N, 1]     no reset in the chunk: the entering state reaches the next chunk
    The masks are in `dtype` (0 or 1) except `same`, a bool.
    """

    def __init__(self, reset: torch.Tensor, chunk_size: int, dtype: torch.dtype):
        seg = to_head_chunks(reset[:, :, None], chunk_size, torch.int32).cumsum(-1)  # [B, 1, N, C]
        self.same = seg[..., :, None] == seg[..., None, :]
        self.from_start = (seg == 0).to(dtype)
        self.to_end = (seg == seg[..., -1:]).to(dtype)
        self.whole = self.from_start[..., -1:]

    @staticmethod
    def of(reset: torch.Tensor | None, chunk_size: int, dtype: torch.dtype) -> "ChunkDocuments | None":
        """None without resets (the chunkwise forms then skip every mask)."""
        return None if reset is None else ChunkDocuments(reset, chunk_size, dtype)


def check_reset(reset: torch.Tensor | None, B: int, T: int) -> None:
    """`reset` must be None or a [B, T] bool tensor (True: clear the state before that step)."""
    if reset is not None and (reset.dtype != torch.bool or reset.shape != (B, T)):
        raise ValueError(f"expected reset [B, T] = {(B, T)} bool, got {tuple(reset.shape)} {reset.dtype}")


def keep_state(reset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1 - reset as [B, T] in `dtype`: what the recurrent forms multiply the state by before each step's update."""
    return (~reset).to(dtype)


def check_shapes(q, k, v, initial_state, per_key: tuple[str, ...] = (), reset=None, **gates) -> None:
    """Fail early with the ops' contract shapes (q, k [B, T, H, K], v [B, T, H, V], gates [B, T, H] or None,
    initial_state [B, H, K, V] or None, reset [B, T] bool or None) rather than deep inside an einsum. The gates named
    in `per_key` may also be [B, T, H, K] (a value per key dimension, as GLA's decay)."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"expected q, k [B, T, H, K] and v [B, T, H, V], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, T, H, K = q.shape
    for name, gate in gates.items():
        if gate is None or gate.shape == (B, T, H) or (name in per_key and gate.shape == (B, T, H, K)):
            continue
        expected = f"[B, T, H] = {(B, T, H)}" + (f" or [B, T, H, K] = {(B, T, H, K)}" if name in per_key else "")
        raise ValueError(f"expected {name} {expected}, got {tuple(gate.shape)}")
    check_reset(reset, B, T)
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"expected initial_state [B, H, K, V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}")


def initial_state_or_zeros(
    initial_state: torch.Tensor | None, q: torch.Tensor, V: int, dtype: torch.dtype
) -> torch.Tensor:
    """The state to start from, in the compute dtype: the given one, or zeros [B, H, K, V] for q [B, T, H, K]."""
    if initial_state is not None:
        return initial_state.to(dtype)
    B, _, H, K = q.shape
    return q.new_zeros(B, H, K, V, dtype=dtype)


@functools.cache
def warn_once(message: str) -> None:
    """Say `message` once per process: a fallback to slower code is never silent, and never repeated every step."""
    warnings.warn(message, stacklevel=3)

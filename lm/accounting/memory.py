"""Per-GPU memory of a training step: a plan from the config, before anything is allocated (`lm bench plan-memory`).

    weights, gradients, optimizer state   from the parameter count and the strategy (what it shards over the world)
    activations                            what autograd keeps for the backward pass, per block
    logits                                 the chunked head's buffers (lm.ops.cross_entropy): never [tokens, vocab]
    Mesa's CG buffers                      the solve's working vectors and chunked key state, one layer at a time
                                           (the mixers' `workspace_bytes_per_token`)
    transient                              one block's backward, which makes gradients as large as what it kept

Activations are counted, not guessed: one block of each mixer runs forward on the CPU at the real width over two
short lengths, under the step's precision, and every tensor autograd saves is summed once (parameters excluded). The
two lengths give bytes = a + b T per sequence, which lm/bench/memory.py showed holds for every mixer (linear in T).

The peak: weights + optimizer state + the autocast cache, plus the larger of two moments. At the start of the backward
pass: all activations + what the head keeps (its weight's and input's gradients) + the larger of the loss's chunk
buffers (which exist only in the forward) and one block's transient with Mesa's buffers. At its end: all gradients +
the head's gradient. With activation checkpointing each block keeps only its input, and one block's activations
exist again while it is recomputed. `lm/bench/plan_memory.py --check` holds this to measured CPU peaks.
"""

from dataclasses import dataclass, replace

import torch

from lm.accounting.flops import param_count
from lm.mixers import MIXERS
from lm.model import Block, LMConfig
from lm.ops.cross_entropy import chunk_tokens
from lm.ops.state_transfer import piece_transfer

GIB = 2**30

STRATEGIES = ("single", "ddp", "fsdp", "zero2", "zero3")


@dataclass
class MemoryPlan:
    """Bytes per GPU."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    mesa_cg: float
    transient: float
    autocast_cache: float
    peak: float

    def gib(self) -> dict[str, float]:
        return {name: value / GIB for name, value in self.__dict__.items()}


def state_bytes(params: int, strategy: str, world_size: int, precision: str) -> tuple[float, float, float]:
    """(weights, gradients, AdamW's two moments) in bytes per GPU. single: one process; ddp: the same, plus DDP's
    gradient buckets on more than one; fsdp: FSDP2, everything sharded; zero2 / zero3: DeepSpeed's bf16 weights and
    gradients with fp32 master weights in the optimizer state, ZeRO-2 sharding gradients and optimizer, ZeRO-3 all."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    n = world_size
    if strategy in ("single", "ddp"):
        buckets = 4 * params if strategy == "ddp" and n > 1 else 0  # DDP's gradient buckets, a second copy
        return 4 * params, 4 * params + buckets, 8 * params
    if strategy == "fsdp":
        return 4 * params / n, 4 * params / n, 8 * params / n
    half = 2 if precision == "bf16-mixed" else 4
    master = 4 * params / n if half == 2 else 0  # fp32 master weights beside the bf16 ones
    if strategy == "zero2":
        return half * params, half * params + 4 * params / n, 8 * params / n + master
    return half * params / n, half * params / n + 4 * params / n, 8 * params / n + master  # zero3


_saved: dict[tuple, int] = {}  # counting runs a block: once per shape


def saved_bytes(cfg: LMConfig, mixer: str, seq_len: int, bf16: bool, before: int = 0, exchange: bool = False) -> int:
    """Bytes autograd keeps for one block of `mixer` at width cfg.d_model, one sequence of seq_len (CPU, counted),
    continuing from the state of `before` earlier tokens (a context-parallel rank's piece). `exchange`: with what a
    recurrent mixer's exchange of transfer maps keeps besides (the input of its recomputed run from the zero state)."""
    exchange = exchange and MIXERS[mixer].recurrent()
    key = (mixer, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.mlp_hidden, repr(cfg.mixer_options.get(mixer)),
           seq_len, bf16, before, exchange)
    if key not in _saved:
        _saved[key] = count_saved_bytes(replace(cfg, n_layers=1, mixer=mixer, layer_pattern=None), seq_len, bf16,
                                        before, exchange)
    return _saved[key]


def count_saved_bytes(cfg: LMConfig, seq_len: int, bf16: bool, before: int = 0, exchange: bool = False) -> int:
    torch.manual_seed(0)
    block = Block(cfg, 0, cfg.mixer)
    state = None
    if before:
        with torch.no_grad():
            _, state = block(torch.randn(1, before, cfg.d_model), None)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    param_shapes = {p.shape for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        # Not the weights, nor autocast's bf16 copies of them (the autocast cache, counted once per model).
        if storage.data_ptr() not in params and not (t.dtype != torch.float32 and t.shape in param_shapes):
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(1, seq_len, cfg.d_model, requires_grad=True)
    normed = []
    block.mixer_norm.register_forward_hook(lambda module, args, out: normed.append(out))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        block(x, state)
        if exchange:  # the piece's transfer map, as lm.mixers.context_parallel.mix_in_parallel runs it
            torch.utils.checkpoint.checkpoint(lambda x: piece_transfer(block.mixer.op_inputs(x, {}, None), None),
                                              normed[0], use_reentrant=False)
    return sum(seen.values())


def preceding_bytes_per_token(cfg: LMConfig, mixer: str, bf16: bool, piece: int) -> float:
    """What one block of `mixer` keeps, per sequence, for each token before its piece of `piece` tokens under context
    parallelism: attention's keys and values of the earlier pieces (on the CPU, where it is counted, also the padded
    queries and outputs of lm.mixers.attention.causal_after_cache: an upper bound for CUDA's kernels), and anything
    that grows with the piece too; 0 where the state that crosses ranks has a fixed size. From counts at two earlier
    lengths (a fixed state cancels) and two piece lengths (what grows with both)."""
    short, long = 128, 256
    growth = {T: (saved_bytes(cfg, mixer, T, bf16, long) - saved_bytes(cfg, mixer, T, bf16, short)) / (long - short)
              for T in (64, 128)}
    per_query = (growth[128] - growth[64]) / 64
    return max(0.0, growth[64] + per_query * (piece - 64))


def activation_bytes(cfg: LMConfig, mixer: str, tokens: int, seq_len: int, bf16: bool, exchange: bool = False) -> float:
    """Bytes kept by one block of `mixer` for micro-batch tokens in sequences of seq_len: a + b T per sequence from
    two counted lengths (whole chunks of 64, where the chunked ops keep the same layout). `exchange`: as in
    saved_bytes."""
    short, long = 128, 256
    a_short, a_long = (saved_bytes(cfg, mixer, n, bf16, exchange=exchange) for n in (short, long))
    per_token = (a_long - a_short) / (long - short)
    per_sequence = a_short - per_token * short
    return tokens / seq_len * per_sequence + tokens * per_token


def workspace_bytes(cfg: LMConfig, tokens: int) -> float:
    """The largest working memory one layer's op holds beyond what autograd saves (each mixer's
    `workspace_bytes_per_token`: Mesa's CG buffers; 0 for the others)."""
    return tokens * max(MIXERS[name].workspace_bytes_per_token(cfg.d_model, cfg.n_heads, cfg.head_dim,
                                                               **cfg.mixer_options.get(name, {}))
                        for name in set(cfg.layer_mixers()))


def plan_memory(cfg: LMConfig, micro_batch: int, seq_len: int, strategy: str = "single", world_size: int = 1,
                precision: str = "bf16-mixed", activation_checkpointing: bool = False,
                context_parallel: int = 1) -> MemoryPlan:
    """The per-GPU memory of a training step of micro_batch sequences of seq_len (see the module docstring), each
    split over context_parallel ranks (lm.mixers.context_parallel): a rank keeps the activations of its piece (a
    recurrent mixer also the input of its exchange's run from the zero state, recomputed in the backward), and the
    last rank also what attention keeps of the pieces before it."""
    bf16 = precision == "bf16-mixed"
    act = 2 if bf16 else 4  # bytes of an activation
    params = param_count(cfg)
    weights, gradients, optimizer = state_bytes(params, strategy, world_size, precision)
    piece = seq_len // context_parallel
    tokens = micro_batch * piece
    before = micro_batch * (seq_len - piece)  # the last rank's earlier tokens
    per_block = [activation_bytes(cfg, mixer, tokens, piece, bf16, exchange=context_parallel > 1) +
                 (before * preceding_bytes_per_token(cfg, mixer, bf16, piece) if before else 0.0)
                 for mixer in cfg.layer_mixers()]
    if activation_checkpointing:
        activations = cfg.n_layers * tokens * cfg.d_model * 4 + max(per_block)  # inputs kept; one block recomputed
    else:
        activations = sum(per_block)
    activations += 3 * tokens * cfg.d_model * 4  # the embedding's output, the final norm's input and output
    head_grad = 4 * cfg.vocab_size * cfg.d_model  # float32, made in the forward pass
    head_kept = head_grad + tokens * cfg.d_model * act  # and the gradient of the head's input
    chunk = min(tokens, chunk_tokens(cfg.vocab_size))
    chunk_buffers = 4 * chunk * cfg.vocab_size * 4  # the loss's logits, soft cap, softmax and gradient, one chunk
    logits = head_kept + chunk_buffers
    mesa_cg = workspace_bytes(cfg, tokens)
    transient = max(per_block)
    autocast_cache = 2 * params if bf16 and strategy in ("single", "ddp", "fsdp") else 0.0  # bf16 copies of weights
    # The chunk buffers live only in the forward pass's loss; a block's backward and Mesa's solve come after them.
    backward_start = activations + head_kept + max(chunk_buffers, transient + mesa_cg)
    peak = weights + optimizer + autocast_cache + max(backward_start, gradients + head_grad)
    return MemoryPlan(weights, gradients, optimizer, activations, logits, mesa_cg, transient, autocast_cache, peak)


def micro_batch_fits(cfg: LMConfig, seq_len: int, gpu_gib, **kwargs) -> dict[str, int]:
    """The largest micro_batch on one GPU of each size (GiB), without and with activation checkpointing:
    {"fits_80gib": ..., "fits_80gib_ckpt": ..., ...}."""
    return {f"fits_{gib:g}gib" + ("_ckpt" if ckpt else ""):
            largest_micro_batch(cfg, seq_len, gib * GIB, activation_checkpointing=ckpt, **kwargs)
            for gib in gpu_gib for ckpt in (False, True)}


def largest_micro_batch(cfg: LMConfig, seq_len: int, gpu_bytes: float, limit: int = 1024, **kwargs) -> int:
    """The largest micro_batch whose planned peak fits in gpu_bytes (0: not even one sequence)."""
    fits = lambda b: plan_memory(cfg, b, seq_len, **kwargs).peak <= gpu_bytes  # noqa: E731
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low

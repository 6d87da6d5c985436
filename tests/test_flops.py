"""accounting.flops against torch.utils.flop_counter.FlopCounterMode on the CPU torch path (float32): the ops,
the attention mixer, the SwiGLU MLP, every mixer and whole models, forward and forward + backward, at two sizes each.

The counter counts matrix products (mm, bmm, einsum, convolutions), as the formulas do; where it is blind, the test
says so and bridges the gap by a stated rule, never by measuring it:
- `linalg_solve_triangular` (the delta rule's inverse, on blocks of 16) has no counter formula: it gets the textbook
  count here;
- PyTorch's CPU flash kernel for scaled_dot_product_attention has none either, so attention runs on the math backend,
  where the counter sees the full T x T products; accounting.flops counts the causal half ((T + 1) / 2 average context);
- the counter's convolution backward ignores groups, overcounting the depthwise short convs' weight gradient by
  their channel count: it gets the forward's count per gradient here;
- elementwise work is not counted by either, but 2 x params includes a mixer's few vector parameters (norm gains,
  gate biases, decays), so mixers and models agree to ~1% rather than exactly (the ops and the MLP do exactly);
- Mesa: accounting.flops charges CG's vector work (dot products and updates, which grow with the steps), which the
  counter does not see, and not the true residual its telemetry measures after each solve (one more matvec), which the
  counter does see: `mesa_unseen` bridges both by their counts.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lm import ops
from lm.accounting import flops
from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig, SwiGLU
from lm.ops import flops as op_flops

TOL = 0.01  # mixers and models: the formulas count their vector parameters, which the counter does not (see below)
EXACT = 1e-9  # the ops and the MLP: the formulas count their products one by one
aten = torch.ops.aten


def solve_triangular_flops(a_shape, b_shape, *args, unitriangular=False, out_shape=None, **kwargs) -> int:
    """Forward substitution with a C x C triangle: C(C - 1) / 2 multiply-adds per right-hand side, plus C divisions
    with a non-unit diagonal."""
    c = a_shape[-1]
    return math.prod(b_shape[:-2]) * b_shape[-1] * (c * (c - 1) if unitriangular else c * c)


def conv_backward_flops(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed, output_padding,
                        groups, output_mask, out_shape=None, **kwargs) -> int:
    """Each gradient (input, weight) of a convolution costs the forward's multiply-adds, 2 x output x weight per
    output channel. The counter's own formula ignores groups for the weight gradient, which makes a depthwise conv's
    (the mixers' ShortConv) channels times too large."""
    assert not transposed
    return sum(output_mask[:2]) * 2 * math.prod(grad_out_shape) * math.prod(w_shape[1:])


CUSTOM = {aten.linalg_solve_triangular: solve_triangular_flops, aten.convolution_backward: conv_backward_flops}


def mesa_unseen(tokens: float, K: int, C: int, steps: list[float], telemetry: bool) -> float:
    """What accounting.flops charges a Mesa call and the counter does not see, less what the counter sees and it does
    not charge: over `tokens` padded token-heads, CG's vector work of each solve at its steps (5K + 10K a step), less
    the telemetry's matvec after each solve (4CK + 2K^2: a chunk's p k^T and its product with k, and the entering
    state), when the call measures it (return_info)."""
    return tokens * sum(op_flops.mesa_cg_vector_flops(K, n) - (4 * C * K + 2 * K * K) * telemetry for n in steps)


def counted(fn) -> tuple[int, int]:
    """FLOPs FlopCounterMode sees in fn(), and in fn() plus the backward of a scalar of its output (like a loss)."""
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False, custom_mapping=CUSTOM) as forward:
            out = fn()
        with FlopCounterMode(display=False, custom_mapping=CUSTOM) as backward:
            out.float().square().mean().backward()
    return forward.get_total_flops(), forward.get_total_flops() + backward.get_total_flops()


def assert_close(analytic: float, count: int, tol: float = TOL):
    assert count > 0
    assert abs(analytic / count - 1) <= tol, f"analytic {analytic:,.0f} vs counted {count:,} ({analytic / count:.4f})"


# ----------------------------------------------------------------------------------------------------------------------
# chunkwise ops: (B, T, H, K, V, chunk); T = 50 is not a multiple of the chunk (padding counts)

OP_SIZES = [(1, 32, 2, 8, 16, 16), (2, 50, 2, 16, 32, 16)]


def op_inputs(B, T, H, K, V, n_gates, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, v = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, V, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    gates = [0.05 + 0.9 * torch.rand(B, T, H, generator=g) for _ in range(n_gates)]
    return [t.requires_grad_() for t in (q, k, v, *gates)]


def op_case(name, B, T, H, K, V, C):
    """(call, analytic forward, analytic forward + backward) of one op, the analytic per padded token x tokens x H."""
    tokens = B * H * math.ceil(T / C) * C  # the chunkwise ops pad T up to a multiple of the chunk
    la, dr = op_flops.linear_attention_op_flops(C, K, V), op_flops.delta_rule_op_flops(C, K, V)
    ml = op_flops.mlstm_op_flops(C, K, V)
    dr_train = op_flops.delta_rule_op_train_flops(C, K, V, math.ceil(T / C))
    if name == "linear_attention":
        q, k, v, log_g, beta = op_inputs(B, T, H, K, V, 2)
        return lambda: ops.linear_attention(q, k, v, log_g.log(), beta, chunk_size=C, backend="torch")[0], \
            tokens * la, tokens * 3 * la
    if name == "delta_rule":
        q, k, v, beta = op_inputs(B, T, H, K, V, 1)
        return lambda: ops.delta_rule(q, k, v, beta, chunk_size=C, backend="torch")[0], tokens * dr, tokens * dr_train
    if name == "gated_delta_rule":
        q, k, v, beta, alpha = op_inputs(B, T, H, K, V, 2)
        return lambda: ops.delta_rule(q, k, v, beta, alpha.log(), chunk_size=C, backend="torch")[0], \
            tokens * dr, tokens * dr_train
    if name == "mlstm":
        q, k, v, i_pre, f_pre = op_inputs(B, T, H, K, V, 2)
        return lambda: ops.mlstm(q, k, v, i_pre, f_pre, chunk_size=C, backend="torch")[0], tokens * ml, tokens * 3 * ml
    if name == "kda":  # a decay per key channel, sub-chunks of 8
        q, k, v, beta, alpha = op_inputs(B, T, H, K, V, 2)
        log_alpha = (alpha[..., None] * torch.linspace(0.5, 1, K)).log()
        return lambda: ops.kda(q, k, v, log_alpha, beta, chunk_size=C, sub_chunk=8, backend="torch")[0], \
            tokens * op_flops.kda_op_flops(C, K, V, 8), \
            tokens * op_flops.kda_op_train_flops(C, K, V, 8, math.ceil(T / C))
    if name == "delta_product":  # n_h = 2: 2T rows, in chunks of C rows
        q, k, v, beta, alpha = op_inputs(B, 2 * T, H, K, V, 2)
        n_chunks = math.ceil(2 * T / C)
        rows = B * H * n_chunks * C / 2  # per token: its rows, padded
        return lambda: ops.delta_product(q[:, :T], k, v, beta, alpha[:, :T].log(), chunk_size=C, backend="torch")[0], \
            rows * op_flops.delta_product_op_flops(C, K, V, 2), \
            rows * op_flops.delta_product_op_train_flops(C, K, V, 2, n_chunks)
    if name == "precond_delta_rule":
        q, k, v, beta, alpha, beta_a, alpha_a = op_inputs(B, T, H, K, V, 4)
        return lambda: ops.precond_delta_rule(q, k, v, beta, alpha.log(), beta_a, alpha_a.log(), chunk_size=C,
                                              backend="torch")[0], \
            tokens * op_flops.precond_delta_rule_op_flops(C, K, V), \
            tokens * op_flops.precond_delta_rule_op_train_flops(C, K, V, math.ceil(T / C))
    steps = int(name.removeprefix("mesa_cg"))
    q, k, v, gamma, beta = op_inputs(B, T, H, K, V, 2)
    lam = torch.ones(H, K, requires_grad=True)
    # As the Mesa mixer calls it: with return_info, which measures each solve's true residual (one more matvec).
    call = lambda: ops.mesa(q, k, v, gamma.log(), beta, lam, cg_steps=steps, chunk_size=C, backend="torch",
                            return_info=True)[0]
    final_key_state = 0 if steps else B * T * H * 2 * K * K  # cg_steps=0 still carries H_T (no loss reads it)
    unseen = (lambda solves: mesa_unseen(tokens, K, C, [steps] * solves, True)) if steps else lambda solves: 0.0
    return (call, tokens * op_flops.mesa_op_flops(C, K, V, steps) + final_key_state - unseen(1),
            tokens * op_flops.mesa_op_train_flops(C, K, V, steps) + final_key_state - unseen(2))


OPS = ["linear_attention", "delta_rule", "gated_delta_rule", "mlstm", "mesa_cg0", "mesa_cg3", "kda", "delta_product",
       "precond_delta_rule"]


@pytest.mark.parametrize("size", OP_SIZES, ids=lambda s: f"T{s[1]}K{s[3]}")
@pytest.mark.parametrize("name", OPS)
def test_op_flops_match_the_counter(name, size):
    call, forward, train = op_case(name, *size)
    counted_forward, counted_train = counted(call)
    assert_close(forward, counted_forward, tol=EXACT)
    assert_close(train, counted_train, tol=EXACT)


def test_the_counters_blind_spots_are_real():
    """Why the test gives the counter formulas and a backend: its defaults miss the delta rule's solve (the forward
    comes out short by exactly that), see nothing of CPU attention, and overcount a depthwise conv's backward."""
    B, T, H, K, V, C = OP_SIZES[0]
    q, k, v, beta = op_inputs(B, T, H, K, V, 1)
    with FlopCounterMode(display=False) as fc:
        ops.delta_rule(q, k, v, beta, chunk_size=C, backend="torch")
    solve = B * T * H * op_flops.unit_lower_inverse_flops(C) / C  # C = 16: one solve per chunk, no halves
    assert fc.get_total_flops() == B * T * H * op_flops.delta_rule_op_flops(C, K, V) - solve
    with FlopCounterMode(display=False) as fc:
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), is_causal=True)
    assert fc.get_total_flops() == 0
    conv, x = torch.nn.Conv1d(64, 64, 4, groups=64, bias=False), torch.randn(1, 64, 32, requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        conv(x).sum().backward()
    forward = 2 * 64 * 29 * 4
    assert fc.get_total_flops() > 3 * forward * 10


# ----------------------------------------------------------------------------------------------------------------------
# attention, MLP, every mixer: (B, T, d_model, n_heads, head_dim, options); T = 40 is not a multiple of the chunk

LAYER_SIZES = [(1, 32, 32, 2, 16, {}), (2, 40, 48, 3, 16, {"n_kv_heads": 1})]
CHUNK = 16
# Small chunks (and a window), so that T = 40 spans several; a mixer without an entry is counted at its defaults.
MIXER_OPTIONS = {"attention": {}, "mamba2": {"chunk_size": CHUNK}, "mlstm": {"chunk_size": CHUNK},
                 "deltanet": {"chunk_size": CHUNK}, "gated_deltanet": {"chunk_size": CHUNK},
                 "mesa": {"chunk_size": CHUNK, "cg_steps": 3}, "swa": {"window": 16},
                 "gla": {"chunk_size": 32, "sub_chunk": 8, "conv_size": 3}, "hawk": {"chunk_size": CHUNK}}


def full_context(name: str, cfg: LMConfig, T: int, training: bool = False) -> float:
    """An attention-like op's FLOPs per token as the counter sees the math backend: every query against all T keys,
    not the mean context (causal (T + 1) / 2, or the window's) that lm counts (the counter ignores the mask, the
    math path computes the masked part too; causal kernels such as flash attention skip it)."""
    cls, options = MIXERS[name], cfg.mixer_options.get(name, {})
    return flops.op_flops(name, cfg, T, training) * T / cls.mean_context(T, **options)


def attention_like(name: str) -> bool:
    return hasattr(MIXERS[name], "mean_context")


def layer_cfg(name, d, h, hd, options, **kwargs) -> LMConfig:
    opts = {**MIXER_OPTIONS.get(name, {}), **(options if name == "attention" else {})}
    return LMConfig(vocab_size=64, d_model=d, n_heads=h, head_dim=hd, mixer=name, mixer_options={name: opts},
                    max_seq_len=64, **kwargs)


@pytest.mark.parametrize("size", LAYER_SIZES, ids=lambda s: f"T{s[1]}d{s[2]}")
@pytest.mark.parametrize("name", sorted(MIXERS))
def test_mixer_flops_match_the_counter(name, size):
    B, T, d, h, hd, options = size
    cfg = layer_cfg(name, d, h, hd, options)
    torch.manual_seed(0)
    mixer = MIXERS[name](d, h, hd, 0, **cfg.mixer_options[name])
    x = torch.randn(B, T, d, requires_grad=True)
    matrices = 2 * flops.mixer_params(name, cfg)
    op, op_train = flops.op_flops(name, cfg, T), flops.op_flops(name, cfg, T, training=True)
    if attention_like(name):  # the counter's full context
        op, op_train = full_context(name, cfg, T), full_context(name, cfg, T, training=True)
    cls = MIXERS[name]
    if not attention_like(name):
        assert cls.flops_per_token(d, h, hd, T, False, **cfg.mixer_options[name]) == matrices + op
    counted_forward, counted_train = counted(lambda: mixer(x)[0])
    # 2 FLOPs per parameter counts the vector ones too (gates' biases, decays, norms: elementwise work the counter
    # does not see); at these toy widths they are up to 2% of a mixer (Hawk's), under 0.1% at the paper's.
    vectors = sum(p.numel() for p in mixer.parameters() if p.dim() <= 1) / sum(p.numel() for p in mixer.parameters())
    unseen = [mesa_layer_unseen(cfg, name, B, T, solves) for solves in (1, 2)]
    assert_close(B * T * (matrices + op) - unseen[0], counted_forward, tol=TOL + vectors)
    assert_close(B * T * (3 * matrices + op_train) - unseen[1], counted_train, tol=TOL + vectors)


def mesa_layer_unseen(cfg: LMConfig, name: str, B: int, T: int, solves: int) -> float:
    """mesa_unseen of a Mesa layer of cfg at its CG steps (0 for any other mixer)."""
    if name != "mesa":
        return 0.0
    chunk, steps = cfg.mixer_options["mesa"]["chunk_size"], cfg.mixer_options["mesa"]["cg_steps"]
    return mesa_unseen(B * cfg.n_heads * math.ceil(T / chunk) * chunk, cfg.head_dim, chunk, [steps] * solves, True)


@pytest.mark.parametrize("size", LAYER_SIZES, ids=lambda s: f"T{s[1]}d{s[2]}")
def test_swiglu_flops_match_the_counter(size):
    B, T, d = size[:3]
    cfg = LMConfig(vocab_size=64, d_model=d)
    mlp, x = SwiGLU(d, cfg.mlp_hidden), torch.randn(B, T, d, requires_grad=True)
    per_token = 2 * 3 * d * cfg.mlp_hidden  # as in forward_flops_per_token
    counted_forward, counted_train = counted(lambda: mlp(x))
    assert_close(B * T * per_token, counted_forward, tol=EXACT)
    assert_close(B * T * 3 * per_token, counted_train, tol=EXACT)


# ----------------------------------------------------------------------------------------------------------------------
# whole models, and the attention T-term only where the layer is attention


@pytest.mark.parametrize("name", [*sorted(MIXERS), "mesa,attention"])
def test_model_flops_match_the_counter(name):
    B, T, d, h, hd = 2, 40, 32, 2, 16
    names = name.split(",")
    cfg = LMConfig(vocab_size=64, d_model=d, n_layers=len(names), n_heads=h, head_dim=hd, mixer=names[0],
                   layer_pattern=name if len(names) > 1 else None, max_seq_len=64,
                   mixer_options={n: MIXER_OPTIONS.get(n, {}) for n in names})
    torch.manual_seed(0)
    model = LanguageModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    gap = sum(full_context(n, cfg, T) - flops.op_flops(n, cfg, T) for n in cfg.layer_mixers() if attention_like(n))
    unseen = [sum(mesa_layer_unseen(cfg, n, B, T, solves) for n in cfg.layer_mixers()) for solves in (1, 2)]
    forward = flops.forward_flops_per_token(cfg, T) + gap - unseen[0] / (B * T)
    train = flops.train_flops_per_token(cfg, T) + 3 * gap - unseen[1] / (B * T)
    counted_forward, counted_train = counted(lambda: model(ids)[0])
    assert_close(B * T * forward, counted_forward)
    assert_close(B * T * train, counted_train)


def test_only_attention_layers_have_a_context_term():
    """A recurrent layer's cost per token does not grow with T (beyond chunk padding); an attention layer's does."""
    for name in sorted(MIXERS):
        cfg = layer_cfg(name, 32, 2, 16, {})
        short, long = (flops.op_flops(name, cfg, T) for T in (64, 4096))
        assert (long > 10 * short) == (name == "attention"), name  # a window of 1024 stops growing at 1024


def test_parameter_counts_with_and_without_embeddings():
    cfg = LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, layer_pattern="mesa,attention",
                   tie_embeddings=False)
    with torch.device("meta"):
        model = LanguageModel(cfg)
    assert flops.param_count(cfg) == model.num_params()
    assert flops.param_count(cfg, embeddings=False) == model.num_params(embeddings=False)



def test_a_tolerance_stopped_mesa_counts_the_steps_it_ran():
    """With cg_tol, the CG loop stops when its last token has converged: the FLOPs a call reports as spent
    (Mesa.flops_spent_per_token, from its telemetry) are what the counter sees it run, forward and with the adjoint
    solve, and far fewer than cg_steps would cost."""
    B, T, d, h, hd = 2, 40, 32, 2, 16
    torch.manual_seed(0)
    options = {"chunk_size": CHUNK, "cg_steps": 30, "cg_tol": 1e-2, "backend": "torch"}
    mixer = MIXERS["mesa"](d, h, hd, 0, **options)
    x = torch.randn(B, T, d, requires_grad=True)
    counted_forward, counted_train = counted(lambda: mixer(x)[0])
    info = {key: float(value) for key, value in mixer.metrics().items()}
    assert 0 < info["cg_iterations_run"] < 30 and 0 < info["cg_adjoint_iterations_run"] < 30
    assert info["cg_iterations_run"] > info["cg_iterations"] + 1  # the loop runs its slowest token's steps
    vectors = sum(p.numel() for p in mixer.parameters() if p.dim() <= 1) / sum(p.numel() for p in mixer.parameters())
    tokens, ran = B * h * math.ceil(T / CHUNK) * CHUNK, [info["cg_iterations_run"], info["cg_adjoint_iterations_run"]]
    assert_close(B * T * mixer.flops_spent_per_token(T, training=False) - mesa_unseen(tokens, hd, CHUNK, ran[:1], True),
                 counted_forward, tol=TOL + vectors)
    assert_close(B * T * mixer.flops_spent_per_token(T, training=True) - mesa_unseen(tokens, hd, CHUNK, ran, True),
                 counted_train, tol=TOL + vectors)
    at_most = mixer.flops_per_token(d, h, hd, T, True, **{**options, "cg_tol": None})
    assert mixer.flops_spent_per_token(T, training=True) < 0.8 * at_most


def test_the_adjoint_solve_is_charged_its_own_cg_steps():
    """A loss that reads the first token alone: the adjoint solve's right-hand side is zero at every other token
    (they take no step), and the first token's system (H_1 + Lambda, a rank-one H_1) converges in a step or two, while
    the forward solve runs until its slowest token has converged. The FLOPs as spent charge each solve its own steps,
    which are what the counter sees run."""
    B, T, d, h, hd = 2, 40, 32, 2, 16
    torch.manual_seed(0)
    mixer = MIXERS["mesa"](d, h, hd, 0, chunk_size=CHUNK, cg_steps=30, cg_tol=1e-2, backend="torch")
    x = torch.randn(B, T, d, requires_grad=True)
    with FlopCounterMode(display=False, custom_mapping=CUSTOM) as counter:
        mixer(x)[0][:, :1].square().sum().backward()
    info = {key: float(value) for key, value in mixer.metrics().items()}
    assert 0 < info["cg_adjoint_iterations_run"] < info["cg_iterations_run"] - 2, info
    vectors = sum(p.numel() for p in mixer.parameters() if p.dim() <= 1) / sum(p.numel() for p in mixer.parameters())
    tokens, ran = B * h * math.ceil(T / CHUNK) * CHUNK, [info["cg_iterations_run"], info["cg_adjoint_iterations_run"]]
    assert_close(B * T * mixer.flops_spent_per_token(T, training=True) - mesa_unseen(tokens, hd, CHUNK, ran, True),
                 counter.get_total_flops(), tol=TOL + vectors)


def test_mesa_at_2_cg_steps_is_charged_its_math_and_not_its_telemetry():
    """A hand count at a tiny size (B 1, T 8, one head, K = V = 2, chunks of 4, 2 CG steps), from the op's algorithm
    (lm/ops/mesa.py), per padded token and head:
    - the key state: each chunk's k^T k (2K^2) and diag(H_t) from the decay weights times k^2 (2CK);
    - a matvec (H_t + Lambda) p: p k^T within the chunk and its product with k (4CK), the entering state (2K^2);
    - a solve: the key state, 3 matvecs (the starting residual, then one a step), and CG's vector work: the Jacobi
      start, the starting residual and its norm (5K), then per step two dot products and three updates (10K);
    - the readout G_t x: a linear attention, 2C(K + V) within the chunk (scores, then scores @ v) and 4KV for the
      chunk's write to the state and the entering state's read;
    - the backward: the right-hand side G_t^T do (a linear attention like the readout), the adjoint solve, and the
      surrogate: the readouts G x and H x each three times (forward and two gradients), less the query gradient of
      q k^T that x's constancy skips (2CK each).
    The op's count as spent equals it, with its telemetry on (return_info: a true residual after each solve, not
    charged) or off; and with telemetry off, the counter sees the matrix products of exactly that count less the
    vector work."""
    from lm.ops.call import OpCall

    B, T, H, K, V, C = 1, 8, 1, 2, 2, 4
    key_state, matvec, readout = 2 * K * K + 2 * C * K, 4 * C * K + 2 * K * K, 2 * C * (K + V) + 4 * K * V
    vector = 5 * K + 2 * 10 * K
    solve = key_state + 3 * matvec + vector
    forward = solve + readout
    surrogate = 3 * (readout + 2 * C * (K + K) + 4 * K * K) - 2 * (2 * C * K)
    train = forward + readout + solve + surrogate
    q, k, v, gamma, beta = op_inputs(B, T, H, K, V, 2)
    lam = torch.ones(H, K, requires_grad=True)
    options = {"cg_steps": 2, "chunk_size": C, "backend": "torch"}
    for telemetry in (True, False):
        call = OpCall("mesa", (q, k, v, gamma.log(), beta, lam), {**options, "return_info": telemetry})
        cost = op_flops.COSTS["mesa"]
        assert cost.spent(call, {}, T, False) == pytest.approx(H * forward, rel=1e-12)  # per token (T = 2 chunks)
        assert cost.spent(call, {}, T, True) == pytest.approx(H * train, rel=1e-12)
    _, counted_train = counted(lambda: ops.mesa(q, k, v, gamma.log(), beta, lam, **options)[0])
    assert counted_train == B * H * T * (train - 2 * vector)

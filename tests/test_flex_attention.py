"""Attention's `kernel: flex` (FlexAttention, lm.mixers.flex_masks) against `kernel: sdpa` on the CPU: the same outputs
and gradients (of the input and of every parameter) for the causal mask, sliding windows with grouped-query heads, odd
lengths, packed documents and a carried KV cache; through a small model; and the block masks skip what a window or
documents mask, which is what makes them cheap on CUDA.

On the CPU, FlexAttention trains only in its math form (float64 here); its compiled C++ kernel (float32, inference
only) runs on the block masks' sparse blocks, so it is checked too, at a length of several blocks. With CUDA, the
compiled kernel that "auto" picks there is checked against SDPA in float64 on the CPU."""

import pytest
import torch

from lm.mixers import MIXERS, MixerOptionError
from lm.mixers.flex_masks import attention_block_mask
from lm.model import LanguageModel, LMConfig
from lm.ops.self_check import BOUNDS

D, HEADS, HEAD_DIM, B, PREFIX = 32, 4, 8, 2, 5
# Row 0: documents start at 0, 6 (a one-token document), 7 and 20; row 1: at 12 and at the last step of T = 37.
RESETS = [[0, 6, 7, 20], [12, 36]]
CASES = [  # (mixer, options, T, with resets)
    ("attention", {}, 19, False),
    ("attention", {"n_kv_heads": 2}, 37, True),
    ("swa", {"window": 1, "n_kv_heads": 1}, 19, True),
    ("swa", {"window": 4, "n_kv_heads": 2}, 37, True),
    ("swa", {"window": 7, "n_kv_heads": 2}, 37, False),
    ("swa", {"window": 7}, 19, True),
]


def build(name: str, kernel: str, dtype=torch.float64, **options):
    torch.manual_seed(0)  # the same weights for both kernels
    mixer = MIXERS[name](D, HEADS, HEAD_DIM, 0, kernel=kernel, **options).to(dtype)
    with torch.no_grad():  # off the initialisation, as tests/test_mixer_math.py does
        for p in mixer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return mixer


def reset_mask(T: int) -> torch.Tensor:
    reset = torch.zeros(B, T, dtype=torch.bool)
    for row, steps in enumerate(RESETS):
        reset[row, [s for s in steps if s < T]] = True
    return reset


def outputs_and_grads(mixer, x, reset, weights):
    """A prefix without state, then the rest with the KV cache carried (and resets): both outputs, and the gradients
    of a fixed linear function of them with respect to x and every parameter."""
    x = x.clone().requires_grad_(True)
    first, state = mixer(x[:, :PREFIX])
    second, _ = mixer(x[:, PREFIX:], state, None if reset is None else reset[:, PREFIX:])
    y = torch.cat([first, second], dim=1)
    grads = torch.autograd.grad((y * weights).sum(), [x, *mixer.parameters()])
    return y.detach(), grads


@pytest.mark.parametrize("name, options, T, resets", CASES, ids=[f"{n}{o}-T{T}{'-resets' * r}" for n, o, T, r in CASES])
def test_flex_equals_sdpa_outputs_and_gradients(name, options, T, resets):
    x = torch.randn(B, T, D, dtype=torch.float64)
    weights = torch.randn(B, T, D, dtype=torch.float64)
    reset = reset_mask(T) if resets else None
    flex_y, flex_grads = outputs_and_grads(build(name, "flex", **options), x, reset, weights)
    sdpa_y, sdpa_grads = outputs_and_grads(build(name, "sdpa", **options), x, reset, weights)
    torch.testing.assert_close(flex_y, sdpa_y, rtol=0, atol=1e-10)
    for flex_grad, sdpa_grad in zip(flex_grads, sdpa_grads, strict=True):
        torch.testing.assert_close(flex_grad, sdpa_grad, rtol=0, atol=1e-10)


def test_flex_token_by_token_with_resets_equals_one_call():
    """Decoding through FlexAttention: one token per call over the carried cache, each with its reset."""
    mixer, T = build("swa", "flex", window=4, n_kv_heads=2), 19
    x, reset = torch.randn(B, T, D, dtype=torch.float64), reset_mask(T)
    whole, _ = mixer(x, None, reset)
    steps, state = [], None
    for t in range(T):
        y, state = mixer(x[:, t:t + 1], state, reset[:, t:t + 1])
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name, options", [("swa", {"window": 7, "n_kv_heads": 2}), ("attention", {})])
def test_compiled_cpu_flex_kernel_equals_sdpa(name, options):
    """torch's compiled CPU FlexAttention (float32, inference only) runs the block mask's sparse and full blocks:
    a length of several 128-token blocks with documents of several lengths."""
    T = 300
    reset = torch.zeros(1, T, dtype=torch.bool)
    reset[0, [0, 90, 91, 200]] = True
    x = torch.randn(1, T, D)
    with torch.no_grad():
        flex, _ = build(name, "flex", torch.float32, **options)(x, None, reset)
        sdpa, _ = build(name, "sdpa", torch.float32, **options)(x, None, reset)
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)


def test_model_with_flex_equals_model_with_sdpa():
    """A hybrid of both attention mixers with documents: logits and every parameter's gradient."""

    def logits_and_grads(kernel: str):
        cfg = LMConfig(vocab_size=32, d_model=D, n_layers=2, n_heads=HEADS, head_dim=HEAD_DIM, mixer="attention",
                       layer_pattern="attention,swa", document_separator=1,
                       mixer_options={"attention": {"kernel": kernel}, "swa": {"window": 5, "kernel": kernel}})
        torch.manual_seed(0)
        model = LanguageModel(cfg).double()
        tokens = torch.randint(2, 32, (2, 23), generator=torch.Generator().manual_seed(1))
        tokens[0, [0, 9, 10]] = tokens[1, 15] = 1  # documents of 9, 1 and 13 tokens; of 15 and 8
        logits, _ = model(tokens)
        return logits.detach(), torch.autograd.grad(logits.square().sum(), list(model.parameters()))

    flex_logits, flex_grads = logits_and_grads("flex")
    sdpa_logits, sdpa_grads = logits_and_grads("sdpa")
    torch.testing.assert_close(flex_logits, sdpa_logits, rtol=0, atol=1e-10)
    for flex_grad, sdpa_grad in zip(flex_grads, sdpa_grads, strict=True):
        torch.testing.assert_close(flex_grad, sdpa_grad, rtol=0, atol=1e-9)


def test_block_masks_keep_only_the_window_and_the_documents():
    """What makes FlexAttention cheap on CUDA: of 16 x 16 blocks of 128, a window of 128 keeps the diagonal and the one
    before it (31 blocks), documents of 256 tokens their causal diagonal squares (3 blocks each); causal keeps 136."""
    T, block = 2048, 128

    def blocks(window=None, document_start=None):
        mask = attention_block_mask(T, 0, window, document_start, torch.device("cpu"))
        full = 0 if mask.full_kv_num_blocks is None else int(mask.full_kv_num_blocks.sum())
        return int(mask.kv_num_blocks.sum()) + full

    document_start = (torch.arange(T) // 256 * 256)[None]
    n = T // block
    assert blocks() == n * (n + 1) // 2
    assert blocks(window=128) == 2 * n - 1
    assert blocks(document_start=document_start) == (n // 2) * 3


def test_auto_picks_flex_on_cuda_for_windows_and_documents_only():
    swa, attention = build("swa", "auto", window=16), build("attention", "auto")
    cuda, cpu, starts = torch.device("cuda"), torch.device("cpu"), torch.zeros(B, 64, dtype=torch.long)
    assert swa.kernel(cuda, 64, 0) == "flex" and swa.kernel(cuda, 16, 0) == "sdpa"  # a window as long as the call
    assert attention.kernel(cuda, 64, 0) == "sdpa" and attention.kernel(cuda, 64, 0, starts) == "flex"
    assert swa.kernel(cuda, 1, 63) == "sdpa"  # decoding
    assert swa.kernel(cpu, 64, 0) == "sdpa" and attention.kernel(cpu, 64, 0, starts) == "sdpa"
    assert build("attention", "flex").kernel(cpu, 1, 5) == "flex"
    with pytest.raises(MixerOptionError, match="option 'kernel' must be"):
        build("attention", "triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, options", [("swa", {"window": 64, "n_kv_heads": 2}), ("attention", {})])
def test_cuda_auto_runs_compiled_flex_and_equals_cpu_sdpa(name, options, monkeypatch):
    """On CUDA, "auto" takes the compiled FlexAttention kernel for a window or documents: its outputs and gradients
    against SDPA's in float64 on the CPU, at a length of several blocks."""
    d, heads, head_dim, T = 256, 4, 64, 512
    reset = torch.zeros(2, T, dtype=torch.bool)
    reset[0, [0, 100, 101, 300]] = reset[1, 257] = True
    x, weights = torch.randn(2, T, d), torch.randn(2, T, d)

    def outputs_and_grads(mixer, device, dtype):
        mixer = mixer.to(device, dtype)
        xd = x.to(device, dtype).requires_grad_(True)
        y, _ = mixer(xd, None, reset.to(device))
        grads = torch.autograd.grad((y * weights.to(device, dtype)).sum(), [xd, *mixer.parameters()])
        return [t.detach().cpu().double() for t in (y, *grads)]

    monkeypatch.setenv("LM_KERNEL_SELF_CHECK", "0")  # the compiled kernel itself, not the math form in its place
    torch.manual_seed(0)
    cuda_mixer = MIXERS[name](d, heads, head_dim, 0, **options)
    assert cuda_mixer.kernel(torch.device("cuda"), T, 0, reset) == "flex"
    sdpa_mixer = MIXERS[name](d, heads, head_dim, 0, kernel="sdpa", **options)
    sdpa_mixer.load_state_dict(cuda_mixer.state_dict())
    got = outputs_and_grads(cuda_mixer, "cuda", torch.float32)
    want = outputs_and_grads(sdpa_mixer, "cpu", torch.float64)
    for g, w in zip(got, want, strict=True):
        assert ((g - w).norm() / w.norm()).item() < BOUNDS["flex"][torch.float32].out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_self_check_keeps_the_compiled_kernel_on_cuda(monkeypatch):
    """With the self-check on (lm.ops.self_check), the compiled kernel passes it against the math form, in bf16 and
    float32, for a window with grouped heads and for documents: a verdict each, all kept."""
    from lm.ops import self_check

    monkeypatch.setenv("LM_KERNEL_SELF_CHECK", "1")
    self_check.forget()
    T = 300
    reset = torch.zeros(2, T, dtype=torch.bool, device="cuda")
    reset[0, [0, 100, 101]] = True
    for dtype in (torch.bfloat16, torch.float32):
        for name, options, resets in (("swa", {"window": 64, "n_kv_heads": 2}, None), ("attention", {}, reset)):
            mixer = MIXERS[name](64, 4, 16, 0, **options).to("cuda", dtype)
            with torch.no_grad():
                mixer(torch.randn(2, T, 64, device="cuda", dtype=dtype), None, resets)
    found = self_check.verdicts()
    print("\nself-check seconds:", {key[2]: round(v.seconds, 2) for key, v in found.items()})
    assert len(found) == 4 and all(v.ok for v in found.values()), found

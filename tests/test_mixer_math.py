"""Every registered mixer against a float64 reference of its paper's equations (tests/mixer_references): outputs and
the gradients of the input and of every parameter, at an odd length spanning several chunks, continuing a carried
state, with resets inside; a registered mixer without a reference fails here.

Every parameter is moved off its initialisation first (norm weights of 1, biases of 0, a skip D of 1 and gates' fixed
starts would hide a changed factor or a dropped term)."""

import pytest
import torch
from mixer_references import REFERENCES

from lm.mixers import MIXERS

D, HEADS, HEAD_DIM, B, PREFIX, T = 32, 4, 8, 2, 5, 19  # 4 heads: groups of 2 show a wrong head-to-group map
RESETS = [[3, 4, 11], [0, 17]]  # row 0: a one-token document, row 1: the carried state dropped at once
CASES = [(name, options) for name in sorted(MIXERS) if name in REFERENCES for options in REFERENCES[name].variants]


def build(name: str, options: dict):
    torch.manual_seed(0)
    mixer = MIXERS[name](D, HEADS, HEAD_DIM, 0, **options).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    if REFERENCES[name].prepare is not None:
        REFERENCES[name].prepare(mixer)
    return mixer


def reset_mask() -> torch.Tensor:
    reset = torch.zeros(B, T, dtype=torch.bool)
    for row, steps in enumerate(RESETS):
        reset[row, steps] = True
    return reset


def outputs_and_grads(forward, mixer, x, weights):
    """Both calls' outputs (a prefix, then the rest with the state carried and resets), and the gradients of a fixed
    linear function of them with respect to x and every parameter."""
    x = x.clone().requires_grad_(True)
    first, state = forward(mixer, x[:, :PREFIX], None, None)
    second, _ = forward(mixer, x[:, PREFIX:], state, reset_mask())
    y = torch.cat([first, second], dim=1)
    params = [p for p in mixer.parameters() if p.requires_grad]
    grads = torch.autograd.grad((y * weights).sum(), [x, *params], allow_unused=True)
    return y.detach(), dict(zip(["x", *(n for n, p in mixer.named_parameters() if p.requires_grad)], grads))


def call_mixer(mixer, x, state, reset):
    return mixer(x, state, reset)


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_every_registered_mixer_has_a_reference(name):
    assert name in REFERENCES, f"mixer {name!r} has no float64 reference in tests/mixer_references"


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}{o or ''}" for n, o in CASES])
def test_forward_and_gradients_equal_the_papers_equations(name, options):
    reference = REFERENCES[name]
    mixer = build(name, options)
    x = torch.randn(B, PREFIX + T, D, dtype=torch.float64)
    weights = torch.randn(B, PREFIX + T, D, dtype=torch.float64)
    y, grads = outputs_and_grads(call_mixer, mixer, x, weights)
    y_ref, grads_ref = outputs_and_grads(reference.forward, mixer, x, weights)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=reference.atol)
    for key, grad in grads.items():
        expected = grads_ref[key]
        if grad is None or expected is None:
            assert grad is None and (expected is None or not expected.any()), f"gradient of {key}"
            continue
        scale = expected.abs().max().clamp_min(1.0)
        torch.testing.assert_close(grad, expected, rtol=0, atol=10 * reference.atol * scale, msg=f"gradient of {key}")

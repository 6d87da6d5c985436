"""Gated DeltaProduct with one Householder step is Gated DeltaNet: the same parameters (loaded strictly from one into
the other) give the same outputs, final state and gradients, from a carried state and with resets, in float64."""

import pytest
import torch

from lm.mixers import MIXERS

D, HEADS, HEAD_DIM, B, T = 24, 3, 8, 2, 19


def run(mixer, x, reset):
    """Output and final state of a prefix, then the rest from its state with resets; the gradients of a fixed linear
    function of the outputs with respect to x and every parameter."""
    x = x.clone().requires_grad_(True)
    first, state = mixer(x[:, :5])
    second, state = mixer(x[:, 5:], state, reset)
    y = torch.cat([first, second], dim=1)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    grads = torch.autograd.grad((y * weights).sum(), [x, *mixer.parameters()])
    return y, state["memory"], dict(zip(["x", *(n for n, _ in mixer.named_parameters())], grads))


@pytest.mark.parametrize("beta_range", [[0.0, 1.0], [0.0, 2.0]])
def test_one_householder_step_is_gated_deltanet(beta_range):
    options = {"chunk_size": 4, "beta_range": beta_range}
    torch.manual_seed(0)
    gdn = MIXERS["gated_deltanet"](D, HEADS, HEAD_DIM, 0, **options).double()
    with torch.no_grad():
        for p in gdn.parameters():  # off the init: a norm weight of 1 would hide a dropped factor
            p.add_(0.2 * torch.randn_like(p))
    product = MIXERS["gated_deltaproduct"](D, HEADS, HEAD_DIM, 0, householder_steps=1, **options).double()
    product.load_state_dict(gdn.state_dict())  # strict: the same parameters, of the same shapes
    x = torch.randn(B, 5 + T, D, dtype=torch.float64)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, [3, 11]] = reset[1, 0] = True
    y, state, grads = run(product, x, reset)
    y_gdn, state_gdn, grads_gdn = run(gdn, x, reset)
    torch.testing.assert_close(y, y_gdn, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, state_gdn, rtol=0, atol=1e-12)
    assert grads.keys() == grads_gdn.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_gdn[name], rtol=0, atol=1e-11, msg=name)

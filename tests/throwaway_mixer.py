"""tests/test_mixer_protocol.py's throwaway mixer, EMA, and its float64 reference: a mixer defined for a test and
registered with one line. In a module of its own, light to import (torch and lm.mixers), because the context-parallel
check's spawned processes import it: the test module itself would bring Lightning into each (seconds apiece)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers import Mixer, register
from lm.mixers.layers import residual_output
from lm.ops.call import OpCall


class EMA(Mixer):
    """A throwaway mixer: an exponential moving average of a projection of the input, h_t = a_t h_{t-1} +
    (1 - a_t) u_t with a data-dependent decay a_t = sigmoid(W_a x_t + b) per channel, then an output projection
    (width W = width * d_model). Nothing else: its parameter count is the protocol's, from a build."""

    @dataclass
    class Options:
        width: float = 1.0

    def __init__(self, d_model, n_heads, head_dim, layer_idx=0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        self.W = int(self.options.width * d_model)
        self.u_proj, self.a_proj = nn.Linear(d_model, self.W, bias=False), nn.Linear(d_model, self.W)
        self.o = residual_output(nn.Linear(self.W, d_model, bias=False))  # not named out_proj: the marker counts

    def op_inputs(self, x, state, reset):
        log_a = F.logsigmoid(self.a_proj(x))
        return OpCall("diagonal_scan", (-torch.expm1(log_a) * self.u_proj(x), log_a))

    def op_output(self, x, out, call):
        return self.o(out.to(x.dtype))


def ema_reference(mixer, x, state, reset):
    """EMA's float64 reference, token by token from its equation (tests/mixer_references' form): u_t = W_u x_t,
    a_t = sigmoid(W_a x_t + b), h_t = a_t h_{t-1} + (1 - a_t) u_t (h cleared at a reset), y_t = W_o h_t."""
    h = x.new_zeros(x.shape[0], mixer.W) if state is None else state
    ys = []
    for t in range(x.shape[1]):
        if reset is not None:
            h = h * (~reset[:, t]).to(x.dtype)[:, None]
        a = torch.sigmoid(x[:, t] @ mixer.a_proj.weight.T + mixer.a_proj.bias)
        h = a * h + (1 - a) * (x[:, t] @ mixer.u_proj.weight.T)
        ys.append(h @ mixer.o.weight.T)
    return torch.stack(ys, dim=1), h


def ema_context_worker(rank: int, world: int, port: int, out: str) -> None:
    """tests/test_context_parallel.py's worker for the throwaway mixer alone, registered in this spawned process as
    the test registers it: nothing of its own for context parallelism."""
    import test_context_parallel

    register("ema")(EMA)
    test_context_parallel.worker(rank, world, port, out, models=["ema"])

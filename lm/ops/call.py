"""A call of an op by its name: what a recurrent mixer hands the rest of `lm` (docs/design.md, "Mixer contract").

A recurrent mixer turns its input into one `OpCall` (its `op_inputs`): the op's name, its positional inputs and its
options. Everything that depends only on the op is then looked up by that name, here and beside it:

    FORMS (here)                  the chunkwise form (training) and the recurrent form (decoding)
    lm.ops.state_transfer         the transfer map of a piece and its composition (context parallelism)
    lm.ops.flops                  FLOPs per token, as planned and as spent, and the op's working memory

so the mixer's forward, `lm bench mixer`'s run of its op and the context-parallel exchange all run the same call. A
new op brings its own entry in each of these tables (tests/test_mixer_protocol.py checks that every op has all).
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable

import torch

from lm.ops.delta_product import delta_product, delta_product_recurrent
from lm.ops.delta_rule import delta_rule, delta_rule_recurrent
from lm.ops.diagonal_scan import diagonal_scan, diagonal_scan_recurrent
from lm.ops.kda import kda, kda_recurrent
from lm.ops.linear_attention import linear_attention, linear_attention_recurrent
from lm.ops.mesa import mesa, mesa_recurrent
from lm.ops.mlstm import mlstm, mlstm_recurrent
from lm.ops.precond_delta_rule import precond_delta_rule, precond_delta_rule_recurrent


@dataclasses.dataclass(frozen=True)
class Forms:
    """An op's two forms: chunkwise(*args, initial_state=, reset=, **options) and recurrent(the same, without the
    options that only the chunkwise form takes, such as chunk_size and backend)."""

    chunkwise: Callable
    recurrent: Callable


FORMS: dict[str, Forms] = {
    "linear_attention": Forms(linear_attention, linear_attention_recurrent),
    "delta_rule": Forms(delta_rule, delta_rule_recurrent),
    "diagonal_scan": Forms(diagonal_scan, diagonal_scan_recurrent),
    "mlstm": Forms(mlstm, mlstm_recurrent),
    "mesa": Forms(mesa, mesa_recurrent),
    "kda": Forms(kda, kda_recurrent),
    "delta_product": Forms(delta_product, delta_product_recurrent),
    "precond_delta_rule": Forms(precond_delta_rule, precond_delta_rule_recurrent),
}


@dataclasses.dataclass
class OpCall:
    """One call of an op: `FORMS[op]` on `args` with `options`. `state` holds the mixer's other state entries after
    this call (its convolutions' last inputs), which depend on the call's inputs alone; `keep` what the mixer's output
    needs besides the op's output (Mamba2's x and z)."""

    op: str
    args: tuple
    options: dict = dataclasses.field(default_factory=dict)
    state: dict = dataclasses.field(default_factory=dict)
    keep: dict = dataclasses.field(default_factory=dict)

    @property
    def forms(self) -> Forms:
        return FORMS[self.op]

    def recurrent_options(self) -> dict:
        """The options the recurrent form takes."""
        accepted = _keywords(self.forms.recurrent)
        return {key: value for key, value in self.options.items() if key in accepted}

    def run(self, initial_state=None, reset: torch.Tensor | None = None, recurrent: bool = False) -> tuple:
        """(out, final state, info): the chunkwise form, or the recurrent one; info is the op's telemetry dict where
        it returns one (Mesa with return_info), else empty."""
        if recurrent:
            out, final, *info = self.forms.recurrent(*self.args, initial_state=initial_state, reset=reset,
                                                     **self.recurrent_options())
        else:
            out, final, *info = self.forms.chunkwise(*self.args, initial_state=initial_state, reset=reset,
                                                     **self.options)
        return out, final, info[0] if info else {}


@functools.cache
def _keywords(form: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(form).parameters)

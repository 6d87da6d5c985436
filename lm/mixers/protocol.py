"""The mixer protocol: what every sequence mixer tells the rest of `lm` about itself, and the registry.

A mixer is one file holding one class, registered with one line (`@register("name")`). The class carries:

    Options             a dataclass of its options, typed, with the papers' defaults; `check_options` checks a
                        config's options against it (names and types), so a typo fails at parse time in one line
    param_count(d_model, n_heads, head_dim, **options) -> int
                        inherited: counted on a build on the meta device, so no formula can drift from the module
    flops_per_token(d_model, n_heads, head_dim, seq_len, training, **options) -> float
                        its projections (2 FLOPs per parameter and token, 6 when training) plus its sequence op
                        (`op_flops_per_token`, which the mixer defines; lm/accounting/flops.py explains what is counted)
    metrics()           what to log after a forward (optional; e.g. Mesa's CG statistics)
    flops_spent_per_token(seq_len, training)
                        its last call's FLOPs per token as run: flops_per_token, unless the work depends on the data
                        (Mesa with cg_tol counts the CG steps its telemetry says ran)
    bench_op(batch, T)  its sequence op, chunkwise and recurrent, with inputs in the ranges its forward feeds them
                        (for `lm bench mixer`; mixers without a recurrent op, such as attention, have none)
    mix_in_context(x, reset, group)
                        its output on this rank's piece of a window under context parallelism: by default the
                        exchange of transfer maps (lm/mixers/context.py), for which a recurrent mixer names its
                        `carried` state entry and gives `piece_transfer` and `carry`; attention gathers keys and values

and, as a class attribute, `paper_heads` (its heads at the paper's sizes, below). The class holds the model and its
accounting only: what a probe, benchmark or demo needs per mixer (MQAR steps, demo learning rates, benchmark
variants, the probes' minimal options) that probe keeps, keyed by mixer name with a default for mixers it does not
list, so that a new mixer needs nothing but its file and its `@register` line. The model, the accounting and training
iterate over MIXERS and read the protocol; they name no mixer. The constructor initialises what the mixer's paper
says (gates, decays), once; the model then initialises the Linear and Embedding weights and biases, except those the
mixer marks with lm.mixers.layers.own_init (a gate bias in a Linear).
"""

import dataclasses
import functools
import types
import typing
from collections.abc import Callable

import torch
from torch import nn

from lm.mixers.context import mix_in_parallel
from lm.mixers.layers import ShortConv

MIXERS: dict[str, type["Mixer"]] = {}


def register(name: str):
    """Class decorator: `@register("gla")` puts the class in MIXERS under `name`."""

    def add(cls):
        cls.name = name
        MIXERS[name] = cls
        return cls

    return add


def at_length(name: str, options: dict, seq_len: int) -> dict:
    """`options` of mixer `name`, with its `length_options` at seq_len wherever `options` leaves them unset."""
    return {**MIXERS[name].length_options(seq_len), **options}


class MixerOptionError(ValueError):
    """A mixer option that its Options dataclass does not have, or of the wrong type. The message is one line."""


@dataclasses.dataclass
class NoOptions:
    pass


def _conforms(value, hint) -> bool:
    """Whether a config value (YAML's int, float, str, bool, None, dict, list) fits a type hint of an Options field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is float:  # YAML writes 1.0 as 1
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


@dataclasses.dataclass
class OpCall:
    """A mixer's sequence op as `lm bench mixer` runs it: both forms, positional inputs, and the output's shape."""

    op: str  # its name in lm.ops
    chunkwise: Callable
    recurrent: Callable
    args: list
    out_shape: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)  # keywords for both forms (e.g. Mesa's CG settings)


@functools.lru_cache(maxsize=4096)
def _built_param_count(cls: type["Mixer"], d_model: int, n_heads: int, head_dim: int, options: tuple) -> int:
    with torch.device("meta"):
        module = cls(d_model, n_heads, head_dim, 0, **dict(options))
    return sum(p.numel() for p in module.parameters())


class Mixer(nn.Module):
    """Base of every mixer: built as `cls(d_model, n_heads, head_dim, layer_idx, **options)`, with
    `forward(x [B, T, D], state=None, reset=None) -> (y [B, T, D], new_state)`; splitting a sequence anywhere and
    carrying the state gives the same output as one call. reset [B, T] bool clears every state of the mixer (recurrent
    state, conv buffers, KV cache entries) before the marked tokens: documents packed in a row see nothing of each
    other (tests/test_mixer_resets.py checks every registered mixer)."""

    name: str = ""  # set by `register`
    Options: type = NoOptions

    # What the rest of lm reads from a mixer class.
    paper_heads: float = 1.0
    """Its heads at the paper's sizes and in `lm compare plan`, as a fraction of the attention model's (Gated
    DeltaNet and GLA keep their papers' keys of d/2 and values of d with half the heads and expand_v 2)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__()
        self.d_model, self.n_heads, self.head_dim, self.layer_idx = d_model, n_heads, head_dim, layer_idx
        self.options = self.check_options(options)

    @classmethod
    def check_options(cls, options: dict) -> typing.Any:
        """The Options of `options`, or a one-line MixerOptionError naming the valid options."""
        fields = {f.name: f for f in dataclasses.fields(cls.Options)}
        valid = ", ".join(fields) or "none"
        hints = typing.get_type_hints(cls.Options)
        for key, value in options.items():
            if key not in fields:
                raise MixerOptionError(f"mixer {cls.name!r} has no option {key!r}; its options: {valid}")
            if not _conforms(value, hints[key]):
                hint = getattr(hints[key], "__name__", None) if isinstance(hints[key], type) else None
                hint = hint or str(hints[key]).replace("typing.", "")
                raise MixerOptionError(f"mixer {cls.name!r} option {key!r} must be {hint}, got {value!r}")
        return cls.Options(**options)

    @classmethod
    def length_options(cls, seq_len: int) -> dict:
        """Options its paper sets in proportion to the training length: at another length, what a config that leaves
        them unset gets in `lm compare plan` (and so the demo) and the probes (SWA: a window of half the sequence, the
        MesaNet paper's 1024 of 2048; otherwise its window would cover a short sequence and make it attention)."""
        return {}

    @classmethod
    def param_count(cls, d_model: int, n_heads: int, head_dim: int, **options) -> int:
        """Parameters of the mixer built with these options: the sum of numel over a build on the meta device (no
        memory, no init; about a millisecond, cached per shape and options, so the planner's thousands of calls cost
        little). An option the constructor rejects raises as the constructor does."""
        cls.check_options(options)  # types first: the cache would take 1 for True
        try:
            return _built_param_count(cls, d_model, n_heads, head_dim, tuple(sorted(options.items())))
        except TypeError:  # an unhashable option value: build without the cache
            return _built_param_count.__wrapped__(cls, d_model, n_heads, head_dim, tuple(sorted(options.items())))

    @classmethod
    def op_flops_per_token(cls, d_model: int, n_heads: int, head_dim: int, seq_len: int, training: bool,
                           **options) -> float:
        """FLOPs per token of the sequence op alone (all heads), forward or forward + backward."""
        raise NotImplementedError

    @classmethod
    def flops_per_token(cls, d_model: int, n_heads: int, head_dim: int, seq_len: int, training: bool,
                        **options) -> float:
        """Forward (training: forward + backward) FLOPs per token of the whole mixer: 2 per parameter (6 training;
        the few vector parameters stand in for elementwise work of about that size) plus the sequence op."""
        matrices = (6 if training else 2) * cls.param_count(d_model, n_heads, head_dim, **options)
        return matrices + cls.op_flops_per_token(d_model, n_heads, head_dim, seq_len, training, **options)

    @classmethod
    def workspace_bytes_per_token(cls, d_model: int, n_heads: int, head_dim: int, **options) -> float:
        """Bytes per token of working memory the op holds beyond what autograd saves, one layer at a time (the
        memory plan, lm.accounting.memory): 0 for most mixers; Mesa's CG buffers."""
        return 0.0

    @classmethod
    def flops_note(cls, **options) -> str | None:
        """What its FLOP count assumes that a plan should say (Mesa with cg_tol: the expected CG steps), or None."""
        return None

    def flops_spent_per_token(self, seq_len: int, training: bool) -> float:
        """FLOPs per token of its last call as it ran (training: with its backward): `flops_per_token` at its own
        shape and options, unless what it runs depends on the data (Mesa's tolerance-stopped CG, from its metrics)."""
        return self.flops_per_token(self.d_model, self.n_heads, self.head_dim, seq_len, training,
                                    **dataclasses.asdict(self.options))

    def metrics(self) -> dict:
        return {}

    # Context parallelism (lm/mixers/context.py): this rank's piece of each window, the pieces before it on the
    # ranks before. A recurrent mixer names the state entry its recurrence carries (its other entries, the convs' last
    # inputs, depend on a piece's inputs alone), and the ranks exchange each piece's transfer map
    # (lm/ops/state_transfer.py). Attention overrides `mix_in_context` and gathers keys and values.
    carried: str | None = None

    def mix_in_context(self, x: torch.Tensor, reset: torch.Tensor | None, group) -> torch.Tensor:
        """The output for this rank's piece x of each window, whose earlier pieces the group's earlier ranks hold."""
        return mix_in_parallel(self, x, reset, group)

    def conv_tail_length(self) -> int:
        """How many of a piece's last inputs its state's non-carried entries (the convs' last inputs) hold."""
        return max((m.size - 1 for m in self.modules() if isinstance(m, ShortConv) and m.size), default=0)

    def piece_transfer(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None):
        """(the `carried` entry this piece ends with from a zero one, its transfer map), for the piece x entered with
        `state`, which holds the other entries (the convs' tails from the piece before; empty on the first)."""
        raise NotImplementedError

    def carry(self, initial, transfer, final):
        """The `carried` entry at a piece's end when it starts from `initial` (None: zero), from the piece's
        transfer map and its end from zero (a mixer sets it to its op's `carry_*` of lm.ops.state_transfer)."""
        raise NotImplementedError

    def bench_op(self, batch: int, T: int) -> OpCall | None:
        """The op's two forms and random positional inputs [B=batch, T, ...] in the ranges this mixer's forward feeds
        them (from its own parameters at init, so they cannot drift from what a layer feeds the op); None for a mixer
        without a recurrent op (attention)."""
        return None


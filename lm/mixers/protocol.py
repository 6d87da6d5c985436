"""The mixer protocol: what every sequence mixer tells the rest of `lm` about itself, and the registry.

A mixer is one file holding one class, registered with one line (`@register("name")`). A recurrent mixer writes:

    Options             a dataclass of its options, typed, with the papers' defaults; `check_options` checks a
                        config's options against it (names and types), so a typo fails at parse time in one line
    __init__            its projections, convolutions, gates and norms
    op_inputs(x, state, reset) -> OpCall
                        its one extension hook: its sequence op's name, inputs and options for the input x, and the
                        state its convolutions carry (lm.ops.call)
    op_output(x, out, call) -> y
                        the layer's output from the op's output (norms, gates, the output projection)

and everything else follows from the op call, looked up by the op's name in lm/ops: `forward` (the chunkwise form,
or the recurrent one for one token after a state), its state ({the convs' entries, "memory": the op's state}), the
op's FLOPs as planned and as spent, its working memory and what a plan should say about it, `lm bench mixer`'s run
of the op (`bench_op`, on a random input through the mixer's own projections), and the exchange of transfer maps
under context parallelism (lm.mixers.context_parallel). Its parameter count comes from a build on the meta device.

Optional: `metrics()` (what to log after a forward, e.g. Mesa's CG statistics, from `op_info`, the op's telemetry),
`length_options` (options its paper sets in proportion to the training length), `paper_heads` (below) and
`reset_mixer_parameters` (its paper's initialisation of gates and decays). A mixer without a recurrent op (attention,
SWA) writes `forward`, `op_flops_per_token` and, for context parallelism, `mix_in_context` itself.

The class holds the model and its accounting only: what a probe, benchmark or demo needs per mixer (MQAR steps, demo
learning rates, benchmark variants, the probes' minimal options) that probe keeps, keyed by mixer name with a default
for mixers it does not list, so that a new mixer needs nothing but its file and its `@register` line. The model, the
accounting and training iterate over MIXERS and read the protocol; they name no mixer. The constructor initialises
what the mixer's paper says (gates, decays), once; the model then initialises the Linear and Embedding weights and
biases, except those the mixer marks with lm.mixers.layers.own_init (a gate bias in a Linear).
"""

import dataclasses
import functools
import json
import types
import typing

import torch
from torch import nn

from lm.mixers.layers import ShortConv
from lm.ops.call import OpCall
from lm.ops.flops import COSTS

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


def _key(options: dict) -> str:
    """Options as a cache key: JSON, as config values are (a list such as beta_range included)."""
    return json.dumps(options, sort_keys=True)


@functools.lru_cache(maxsize=4096)
def _built_param_count(cls: type["Mixer"], d_model: int, n_heads: int, head_dim: int, options: str) -> int:
    with torch.device("meta"):
        module = cls(d_model, n_heads, head_dim, 0, **json.loads(options))
    return sum(p.numel() for p in module.parameters())


@functools.lru_cache(maxsize=4096)
def _planned_call(cls: type["Mixer"], d_model: int, n_heads: int, head_dim: int, options: str,
                  training: bool) -> OpCall:
    """The mixer's op call for one token, built and run on the meta device (no memory, no compute): the op's name,
    its inputs' shapes and its options, in training or in evaluation, for counting without a model.

    Built without autograd: where the first call comes inside a block that activation checkpointing runs again
    (context parallelism asks the op's name there), what it saved for a backward would be missing from the
    recomputation, which finds the call cached, and torch's checkpoint refuses the difference (a CheckpointError)."""
    with torch.device("meta"), torch.no_grad():
        module = cls(d_model, n_heads, head_dim, 0, **json.loads(options)).train(training)
        return module.op_inputs(torch.empty(1, 1, d_model), {}, None)


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
        self.op_info: dict = {}  # the last op call's telemetry (Mesa's CG statistics), empty for most ops

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

    # The extension hook of a recurrent mixer, and what follows from it.

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None) -> OpCall:
        """Its sequence op's call for input x [B, T, D], entered with `state` (its convs' entries; {} at the start):
        the op's name in lm.ops, its inputs and options, and the convs' new entries (OpCall.state). A mixer without
        a recurrent op (attention) has none."""
        raise NotImplementedError

    def op_output(self, x: torch.Tensor, out: torch.Tensor, call: OpCall) -> torch.Tensor:
        """The layer's output [B, T, D] from the op's output `out` for the input x."""
        raise NotImplementedError

    @classmethod
    def recurrent(cls) -> bool:
        """Whether the mixer is built on an op of lm.ops (it defines `op_inputs`)."""
        return cls.op_inputs is not Mixer.op_inputs

    def forward(self, x: torch.Tensor, state: dict | None = None, reset: torch.Tensor | None = None):
        """The op call's chunkwise form, or its recurrent one for a single token after a state (decoding); the new
        state is the call's conv entries and the op's state under "memory"."""
        state = state or {}
        call = self.op_inputs(x, state, reset)
        decoding = x.shape[1] == 1 and state.get("memory") is not None
        out, memory, self.op_info = call.run(state.get("memory"), reset, recurrent=decoding)
        return self.op_output(x, out, call), {**call.state, "memory": memory}

    def conv_tail_length(self) -> int:
        """How many of a piece's last inputs its state's conv entries hold (context parallelism)."""
        return max((m.size - 1 for m in self.modules() if isinstance(m, ShortConv) and m.size), default=0)

    def op_name(self) -> str:
        """The name in lm.ops of the op this mixer calls."""
        return self.planned_call(self.d_model, self.n_heads, self.head_dim, self.training,
                                 **dataclasses.asdict(self.options)).op

    @classmethod
    def planned_call(cls, d_model: int, n_heads: int, head_dim: int, training: bool, **options) -> OpCall:
        """Its op call for one token on the meta device: what the accounting reads (the op, the inputs' shapes, the
        options: Mesa's CG steps in training or in evaluation)."""
        return _planned_call(cls, d_model, n_heads, head_dim, _key(options), training)

    @torch.no_grad()
    def bench_op(self, batch: int, T: int) -> OpCall | None:
        """Its op call on a random input x [batch, T, D] through its own projections and gates at init, so that the
        op's inputs are in the ranges a layer feeds them (`lm bench mixer`); None without a recurrent op."""
        if not self.recurrent():
            return None
        x = torch.randn(batch, T, self.d_model, dtype=next(self.parameters()).dtype)
        return self.op_inputs(x, {}, None)

    # Accounting.

    @classmethod
    def param_count(cls, d_model: int, n_heads: int, head_dim: int, **options) -> int:
        """Parameters of the mixer built with these options: the sum of numel over a build on the meta device (no
        memory, no init; about a millisecond, cached per shape and options, so the planner's thousands of calls cost
        little). An option the constructor rejects raises as the constructor does."""
        cls.check_options(options)  # types first: JSON keeps True apart from 1
        return _built_param_count(cls, d_model, n_heads, head_dim, _key(options))

    @classmethod
    def op_flops_per_token(cls, d_model: int, n_heads: int, head_dim: int, seq_len: int, training: bool,
                           **options) -> float:
        """FLOPs per token of the sequence op alone (all heads), forward or forward + backward: its op's count
        (lm.ops.flops.COSTS) for its call. A mixer without a recurrent op counts its own."""
        call = cls.planned_call(d_model, n_heads, head_dim, training, **options)
        return COSTS[call.op].flops(call, seq_len, training)

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
        memory plan, lm.accounting.memory): its op's (Mesa's CG buffers; 0 for most)."""
        if not cls.recurrent():
            return 0.0
        call = cls.planned_call(d_model, n_heads, head_dim, True, **options)
        return COSTS[call.op].workspace(call)

    @classmethod
    def flops_note(cls, d_model: int, n_heads: int, head_dim: int, **options) -> str | None:
        """What its FLOP count assumes that a plan should say (Mesa with cg_tol: the expected CG steps), or None."""
        if not cls.recurrent():
            return None
        return COSTS[(call := cls.planned_call(d_model, n_heads, head_dim, True, **options)).op].note(call)

    def flops_spent_per_token(self, seq_len: int, training: bool) -> float:
        """FLOPs per token of its last call as it ran (training: with its backward): `flops_per_token` at its own
        shape and options, with the op's own count as run where what it runs depends on the data (Mesa's
        tolerance-stopped CG, from `op_info`)."""
        options = dataclasses.asdict(self.options)
        counted = self.flops_per_token(self.d_model, self.n_heads, self.head_dim, seq_len, training, **options)
        if not self.recurrent():
            return counted
        call = self.planned_call(self.d_model, self.n_heads, self.head_dim, training, **options)
        cost = COSTS[call.op]
        if cost.spent is None:
            return counted
        return counted - cost.flops(call, seq_len, training) + cost.spent(call, self.op_info, seq_len, training)

    def metrics(self) -> dict:
        return {}

"""The shape of a language model (LMConfig), apart from the model (lm.model) and without torch: parsing a run's
config (lm.training.config) imports this, and a mistake in it ends in one line before torch's import, which costs a
process seconds (docs/training.md, "What `lm train` checks first").

An LMConfig checks itself when it is made, in two steps: first what needs no torch (sizes, the mixers' names and
their options' names against lm/mixers' sources, lm.mixer_catalogue; the pattern against the depth), then the full
check with the mixer registry (each option's type, each mixer built on the meta device), which imports torch. Within
`mixers_built_later()` the second step is left to the caller: jsonargparse makes the default LMConfig before it reads
any argument, and the config's own before the rest of the run config is checked, so `lm train` parses the whole
config first and then calls check_mixers (lm.training.config.parse_run_config).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from lm.mixer_catalogue import Catalogue, known_mixers
from lm.util.errors import UserError

BUILT_LATER: ContextVar[bool] = ContextVar("mixers_built_later", default=False)


@contextmanager
def mixers_built_later() -> Iterator[None]:
    """Within it, an LMConfig made checks what needs no torch, and leaves check_mixers to the caller."""
    token = BUILT_LATER.set(True)
    try:
        yield
    finally:
        BUILT_LATER.reset(token)


@dataclass
class LMConfig:
    """Shape of a language model.

    Args:
        vocab_size: Rows of the embedding; at least the tokenizer's vocabulary.
        d_model: Width of the residual stream.
        n_layers: Number of blocks.
        n_heads: Heads of each mixer.
        head_dim: Key size per head (the paper uses 128).
        mixer: Name in ``lm.mixers.MIXERS`` used by every layer unless ``layer_pattern`` is given.
        mixer_options: Keyword options per mixer name, e.g. ``{"attention": {"n_kv_heads": 2}}``.
        layer_pattern: Comma-separated mixer names repeated over the depth, e.g. ``"mesa,attention"``; n_layers must
            be a whole number of patterns, unless ``cycle_pattern`` says otherwise.
        cycle_pattern: Let a ``layer_pattern`` that does not tile n_layers be cut at the depth (its first layers
            repeated: "gated_deltanet,attention" over 3 layers is two Gated DeltaNet and one attention). Without it
            that is refused, since a cut pattern changes the model's mix of mixers (3:1 over 2 layers has no attention).
        mlp_ratio: SwiGLU hidden width as a multiple of d_model (3 gives the paper's 9 d^2 parameters).
        tie_embeddings: Share the embedding matrix with the output head.
        logit_soft_cap: Logits become ``cap * tanh(logits / cap)``; None disables it.
        max_seq_len: Longest training sequence the model is meant for.
        norm_eps: Epsilon of the RMSNorms.
        init_std: Standard deviation of the normal initialisation.
        document_separator: The token id that starts every document (the data's separator), when the model resets
            every mixer's state there (documents packed in one row see nothing of each other); None: no resets.
            ``lm train`` sets it from ``data.reset_at_documents``; evaluation and generation then reset alike.
    """

    vocab_size: int = 50304
    d_model: int = 768
    n_layers: int = 14
    n_heads: int = 6
    head_dim: int = 128
    mixer: str = "attention"
    mixer_options: dict[str, dict] = field(default_factory=dict)
    layer_pattern: str | None = None
    cycle_pattern: bool = False
    mlp_ratio: float = 3.0
    tie_embeddings: bool = True
    logit_soft_cap: float | None = 30.0
    max_seq_len: int = 2048
    norm_eps: float = 1e-6
    init_std: float = 0.02
    document_separator: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise UserError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.document_separator is not None and not 0 <= self.document_separator < self.vocab_size:
            raise UserError(f"model.document_separator {self.document_separator} is not a token id below vocab_size "
                            f"{self.vocab_size}")
        self.check_names(known_mixers())
        pattern = self.pattern()
        if self.n_layers % len(pattern) and not self.cycle_pattern:
            raise UserError(f"model.layer_pattern has {len(pattern)} layers ({', '.join(pattern)}), which do not tile "
                            f"model.n_layers {self.n_layers}: the model would be {mixer_counts(self.layer_mixers())}. "
                            f"Make n_layers a multiple of {len(pattern)}, or set model.cycle_pattern true to cut the "
                            "pattern on purpose")
        if not BUILT_LATER.get():
            self.check_mixers()

    def mixer_names(self) -> list[str]:
        """Every mixer the config names, in its layers or in mixer_options, sorted."""
        return sorted(set(self.layer_mixers()) | set(self.mixer_options))

    def check_names(self, catalogue: Catalogue) -> None:
        """The mixers' names and their options' names against `catalogue` (lm.mixer_catalogue: read from lm/mixers'
        sources, without torch), refused in the words of the full check (check_mixers) where the catalogue is sure;
        what it does not know (a mixer registered from outside lm/mixers) is left to the full check."""
        for name in self.mixer_names():
            options = self.mixer_options.get(name) or {}
            if not isinstance(options, dict):
                raise UserError(f"model.mixer_options.{name} must be a mapping of option names to values, got "
                                f"{options!r}")
            if name not in catalogue.options:
                if catalogue.complete:
                    raise UserError(f"unknown mixer {name!r}; known: {', '.join(sorted(catalogue.options))}")
                continue
            valid = catalogue.options[name]
            if valid is not None and (unknown := [key for key in options if key not in valid]):
                raise UserError(f"model.mixer_options.{name}: mixer {name!r} has no option {unknown[0]!r}; its "
                                f"options: {', '.join(valid) or 'none'}")

    def check_mixers(self) -> None:
        """The full check of every mixer named, with the registry (lm.mixers, which imports torch): the name, its
        options against its Options (names, types), then a build on the meta device (no memory, no init cost) for
        what only the constructor knows (e.g. heads that do not divide): at parse time, in one line."""
        import torch

        from lm.mixers import MIXERS, MixerOptionError

        for name in self.mixer_names():
            if name not in MIXERS:
                raise UserError(f"unknown mixer {name!r}; known: {', '.join(sorted(MIXERS))}")
            options = self.mixer_options.get(name) or {}
            try:
                MIXERS[name].check_options(options)
                with torch.device("meta"):
                    MIXERS[name](self.d_model, self.n_heads, self.head_dim, 0, **options)
            except (MixerOptionError, ValueError) as err:
                raise UserError(f"model.mixer_options.{name}: {err}") from None

    def pattern(self) -> list[str]:
        """The mixer names of ``layer_pattern``, else ``[mixer]``."""
        return [s.strip() for s in self.layer_pattern.split(",")] if self.layer_pattern else [self.mixer]

    def layer_mixers(self) -> list[str]:
        """The mixer name of every layer: ``layer_pattern`` repeated over the depth, else ``mixer`` everywhere."""
        pattern = self.pattern()
        return [pattern[i % len(pattern)] for i in range(self.n_layers)]

    def layer_summary(self) -> str:
        """The layers' mixers in words, as `lm train` starts by saying: "4 layers: gated_deltanet x3, attention x1"
        (each mixer's count, in the order of the pattern), with the cut said where cycle_pattern cut it."""
        pattern = self.pattern()
        cut = f" (cycled: the {len(pattern)}-layer pattern cut at {self.n_layers})" \
            if self.n_layers % len(pattern) else ""
        return f"{self.n_layers} layer{'s' * (self.n_layers != 1)}: {mixer_counts(self.layer_mixers())}{cut}"

    def unused_mixer_options(self) -> list[str]:
        """The mixers that ``mixer_options`` has options for but no layer uses."""
        return sorted(set(self.mixer_options) - set(self.layer_mixers()))

    def own_mixer_options(self) -> dict[str, dict]:
        """``mixer_options`` without the options of mixers that no layer uses (a base shared by several mixers)."""
        used = set(self.layer_mixers())
        return {mixer: options for mixer, options in self.mixer_options.items() if mixer in used}

    @property
    def mlp_hidden(self) -> int:
        return int(round(self.mlp_ratio * self.d_model))


def mixer_counts(mixers: list[str]) -> str:
    """"gated_deltanet x3, attention x1": each name's count, in the order of first appearance."""
    return ", ".join(f"{name} x{mixers.count(name)}" for name in dict.fromkeys(mixers))

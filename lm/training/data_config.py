"""The `data` section of a run config (DataConfig, its sources: DataSource) and its checks, apart from the token
windows it describes (lm.training.data) and without torch or NumPy: parsing a run's config (lm.training.config)
imports this, and a mistake in it ends in one line before torch's import, which costs a process seconds."""

import re
from dataclasses import dataclass
from pathlib import Path

from lm.util.errors import UserError


@dataclass
class DataSource:
    """One prepared directory of a mixture (data.sources). Give every source a weight, or every source tokens.

    Args:
        path: Directory written by ``lm prepare``.
        weight: Its share of the training windows (the weights are normalised to sum to 1).
        tokens: Instead of a weight: the training tokens it gives the whole run (the sources' tokens must add up to
            the run's, max_steps x global batch x seq_len).
        name: Its name in the logs (data/tokens/NAME, val/loss/NAME); default: the directory's name.
    """

    path: str
    weight: float | None = None
    tokens: int | None = None
    name: str | None = None

    @property
    def amount(self) -> float | None:
        """Its weight, or else its tokens: what the shares are proportional to."""
        return self.weight if self.weight is not None else self.tokens


@dataclass
class DataConfig:
    """Where the tokens come from and how they are cut.

    Args:
        path: Directory written by ``lm prepare`` (manifest.json, tokenizer.json, shards); default data/prepared.
            A mixture of one source.
        sources: Instead of path: prepared directories mixed by weight (one tokenizer), each a mapping of path,
            weight (or tokens) and name. Every source's share of the training windows is its weight, at every point
            of the run; validation is logged per source (val/loss/NAME) and as their weighted mean (val/loss).
        seq_len: Tokens per training sequence.
        micro_batch: Sequences per device per forward pass.
        global_batch: Sequences per optimizer step over all devices (None: micro_batch x accumulate x world).
        global_batch_tokens: The same in tokens (a multiple of seq_len); give either.
        num_workers: Data-loader worker processes per device.
        seed: Seed of the window order (None: the run's seed, so that a seed varies the initialisation and the
            data order together; set it to fix the order across seeds on purpose).
        val_windows: Validation windows evaluated each time, per source (None: all of them; 0: no validation at
            all).
        verify: Check every shard's sha256 against the manifest when loading.
        reset_at_documents: Start every document of a window from an empty state (every mixer's state, conv buffers
            and KV cache cleared at the separator, attention masked block-diagonally, RoPE positions from the
            document's start). Off by default, as in the MesaNet paper's recipe. The model keeps it (as
            ``model.document_separator``), so evaluation and generation reset alike.
    """

    path: str | None = None
    sources: list[DataSource] | None = None
    seq_len: int = 2048
    micro_batch: int = 8
    global_batch: int | None = None
    global_batch_tokens: int | None = None
    num_workers: int = 1
    seed: int | None = None
    val_windows: int | None = 256
    verify: bool = True
    reset_at_documents: bool = False

    def __post_init__(self):
        if self.val_windows is not None and self.val_windows < 0:
            raise UserError(f"data.val_windows must be 0 (no validation), positive or null (all), got "
                            f"{self.val_windows}")
        if self.sources is not None:
            if self.path is not None:
                raise UserError("give data.path or data.sources, not both (a path is a mixture of one)")
            self.sources = [DataSource(**s) if isinstance(s, dict) else s for s in self.sources]
            check_sources(self.sources)

    def mixture(self) -> list[DataSource]:
        """The sources with their names and weights filled in (normalised; from tokens where given)."""
        if self.sources is None:
            path = self.path or "data/prepared"
            return [DataSource(path, 1.0, None, source_name(path))]
        total = sum(s.amount for s in self.sources)
        return [DataSource(s.path, s.amount / total, s.tokens, s.name or source_name(s.path)) for s in self.sources]

    @property
    def first_path(self) -> str:
        """The directory whose tokenizer and manifest the run takes (every source shares them)."""
        return self.mixture()[0].path


NAME = re.compile(r"[A-Za-z0-9_.-]+")


def source_name(path: str) -> str:
    """A source's default name: its directory's name."""
    return Path(path).resolve().name or "data"


def check_sources(sources: list[DataSource]) -> None:
    """data.sources is a non-empty list, all weights or all tokens, positive, names unique and fit for log keys."""
    if not sources:
        raise UserError("data.sources is empty: list at least one prepared directory, or give data.path")
    for s in sources:
        if (s.weight is None) == (s.tokens is None):
            raise UserError(f"data.sources: {s.path} needs a weight or tokens (one of them)")
        if not s.amount > 0:
            raise UserError(f"data.sources: {s.path} has a weight or tokens that is not positive")
    if len({s.weight is None for s in sources}) > 1:
        raise UserError("data.sources: give every source a weight, or every source tokens, not a mix")
    names = [s.name or source_name(s.path) for s in sources]
    if bad := [n for n in names if not NAME.fullmatch(n)]:
        raise UserError(f"data.sources: name {bad[0]!r} may hold only letters, digits, '_', '.' and '-'")
    if len(set(names)) < len(names):
        raise UserError(f"data.sources: two sources are named {sorted(n for n in names if names.count(n) > 1)[0]!r}: "
                        "give each a name")

"""The backbone shared by every mixer (MesaNet paper, App. E): embedding, blocks of pre-RMSNorm mixer and
pre-RMSNorm SwiGLU MLP with residuals, a final norm, a tied head with an optional logit soft cap."""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from lm.mixers import MIXERS, MixerOptionError
from lm.mixers.context_parallel import ContextGroup, mix_in_context
from lm.mixers.layers import residual_output
from lm.ops.cross_entropy import head_cross_entropy
from lm.util.errors import UserError


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
        for name in sorted(set(self.layer_mixers()) | set(self.mixer_options)):
            if name not in MIXERS:
                raise UserError(f"unknown mixer {name!r}; known: {', '.join(sorted(MIXERS))}")
            self._check_mixer(name)
        pattern = self.pattern()
        if self.n_layers % len(pattern) and not self.cycle_pattern:
            raise UserError(f"model.layer_pattern has {len(pattern)} layers ({', '.join(pattern)}), which do not tile "
                            f"model.n_layers {self.n_layers}: the model would be {mixer_counts(self.layer_mixers())}. "
                            f"Make n_layers a multiple of {len(pattern)}, or set model.cycle_pattern true to cut the "
                            "pattern on purpose")

    def _check_mixer(self, name: str) -> None:
        """Options against the mixer's Options (names, types), then a build on the meta device (no memory, no init
        cost) for what only the constructor knows (e.g. heads that do not divide): at parse time, in one line."""
        options = self.mixer_options.get(name) or {}
        if not isinstance(options, dict):
            raise UserError(f"model.mixer_options.{name} must be a mapping of option names to values, got {options!r}")
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


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = residual_output(nn.Linear(hidden, d_model, bias=False))

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig, layer_idx: int, mixer_name: str):
        super().__init__()
        self.mixer_name = mixer_name
        self.mixer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        options = cfg.mixer_options.get(mixer_name, {})
        self.mixer = MIXERS[mixer_name](cfg.d_model, cfg.n_heads, cfg.head_dim, layer_idx, **options)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden)

    def forward(self, x, state=None, reset=None, context: ContextGroup | None = None, recompute: bool = False):
        """(x after the block, the mixer's state). With `context` (context parallelism) x is this rank's piece of
        each window, and the mixer exchanges what it needs with the group (lm.mixers.context_parallel); no state is
        returned. `recompute`: keep only the input and run again in the backward pass (activation checkpointing),
        the exchange included, which every rank of the group recomputes in the same order."""
        if recompute:
            return torch.utils.checkpoint.checkpoint(self.mix, x, state, reset, context, use_reentrant=False)
        return self.mix(x, state, reset, context)

    def mix(self, x, state=None, reset=None, context: ContextGroup | None = None):
        if context is None:
            y, state = self.mixer(self.mixer_norm(x), state, reset)
        else:
            y, state = mix_in_context(self.mixer, self.mixer_norm(x), reset, context), None
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state


class LanguageModel(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i, name) for i, name in enumerate(cfg.layer_mixers()))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.activation_checkpointing = False  # recompute each block in the backward pass (set for training)
        self.context: ContextGroup | None = None  # context parallelism: this rank's piece of each window (training)
        self.reset_parameters()

    def reset_parameters(self):
        """Normal(0, init_std) for matrices, scaled by 1/sqrt(2 n_layers) on the residual outputs (GPT-2: the
        projections marked with lm.mixers.layers.residual_output), and zero biases. What a mixer initialises itself
        (its gates and decays, which know their papers' initialisations) its constructor has done, once: the
        parameters of other kinds than these are not touched here, and those marked with lm.mixers.layers.own_init
        (gate biases in a Linear) are left as the constructor set them."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = self.cfg.init_std
                if getattr(module.weight, "residual_output", False):
                    std /= math.sqrt(2 * self.cfg.n_layers)
                if not getattr(module.weight, "own_init", False):
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                bias = getattr(module, "bias", None)
                if bias is not None and not getattr(bias, "own_init", False):
                    nn.init.zeros_(bias)

    @classmethod
    def from_pretrained(cls, directory: str) -> "LanguageModel":
        """The model `lm export` wrote to `directory` (config.json + model.safetensors), in eval mode; either format:
        lm's own, or Hugging Face's (`--format hf`: model_type "lm", the LMConfig under "lm", tensors under "model.").
        """
        import json
        from pathlib import Path

        from safetensors.torch import load_file

        directory = Path(directory)
        for name in ("config.json", "model.safetensors"):
            if not (directory / name).is_file():
                raise UserError(f"{directory / name} not found (write it with lm export)")
        try:
            config, prefix = json.loads((directory / "config.json").read_text()), ""
            if "model_type" in config:  # a Hugging Face directory
                if config["model_type"] != "lm":
                    raise UserError(f"{directory} holds a {config['model_type']!r} model, not an lm model")
                config, prefix = config["lm"], "model."
            model = cls(LMConfig(**config))
            weights = load_file(str(directory / "model.safetensors"))
            model.load_state_dict({k.removeprefix(prefix): v for k, v in weights.items()})
        except UserError:
            raise
        except Exception as err:
            # bad JSON, an unknown config key, a damaged safetensors file (its own error class), tensors of other
            # names or shapes
            reason = str(err).strip().splitlines()
            raise UserError(f"cannot load {directory}: {' '.join(reason[:2])[:300]}") from None
        return model.eval()

    def mixer_metrics(self) -> dict[str, torch.Tensor]:
        """What the mixers report about their last call (each mixer's optional `metrics()`), as 0-dim tensors with
        no host sync: "layer{i}/{name}" per block, and "{name}" over the blocks that report it, the mean (the max
        for names ending in "_max")."""
        per_layer, by_name = {}, {}
        for i, block in enumerate(self.blocks):
            for name, value in (block.mixer.metrics() if hasattr(block.mixer, "metrics") else {}).items():
                per_layer[f"layer{i}/{name}"] = value
                by_name.setdefault(name, []).append(value)
        overall = {name: torch.stack(values).amax() if name.endswith("_max") else torch.stack(values).mean()
                   for name, values in by_name.items()}
        return {**overall, **per_layer}

    def num_params(self, embeddings: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings else n - self.embed.weight.numel()

    def forward(self, input_ids: torch.Tensor, state: list | None = None, reset: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, reduction: str = "mean") -> tuple[torch.Tensor, list]:
        """Logits [B, T, vocab] for input_ids [B, T], and the per-layer state to continue from.

        With targets [B, T], the cross-entropy (float32) instead of the logits: their mean, or with reduction "none"
        (no gradient) the loss [B, T] of each token. The head then runs over chunks of tokens
        (`lm.ops.cross_entropy`), so the [B, T, vocab] logits never exist whole, in training or in evaluation.

        reset [B, T] bool: every mixer's state (recurrent state, conv buffers, KV cache) is cleared before the marked
        tokens, so the documents packed in a row see nothing of each other. By default it is
        ``input_ids == cfg.document_separator`` for a model trained with resets, and no reset otherwise.

        With `self.context` set (context parallelism), input_ids is this rank's piece of each window and every rank of
        the group calls forward together; each returns its piece's logits or loss."""
        if reset is None and self.cfg.document_separator is not None:
            reset = input_ids == self.cfg.document_separator
        context = self.context
        if context is not None and state is not None:
            raise ValueError("a context-parallel forward starts every window from an empty state")
        x = self.embed(input_ids)
        state = state or [None] * len(self.blocks)
        new_state = []
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block, layer_state in zip(self.blocks, state):
            x, layer_state = block(x, layer_state, reset, context, recompute)
            new_state.append(layer_state)
        x = self.norm(x)
        head = self.embed.weight if self.head is None else self.head.weight
        cap = self.cfg.logit_soft_cap
        if targets is not None:
            loss = head_cross_entropy(x.flatten(0, 1), head, targets.flatten(), cap, reduction)
            return (loss if reduction == "mean" else loss.view(targets.shape)), new_state
        if not cap:
            return F.linear(x, head), new_state
        # cap * tanh(logits / cap), dividing x (d_model wide) rather than the logits (vocab wide): the same up to
        # rounding, and one pass less over the largest activation, forward and backward.
        return cap * torch.tanh(F.linear(x / cap, head)), new_state

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue input_ids [B, T] by at most max_new_tokens, one token at a time from the carried state
        (a KV cache for attention, the recurrent state otherwise). temperature 0 is greedy. Rows that emit
        eos_id stop there (later positions are filled with eos_id); returns [B, T + n_generated]."""
        logits, state = self(input_ids)
        out, done = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            token = sample_next(logits[:, -1].float(), temperature, top_k, top_p, generator)
            if eos_id is not None:
                token = torch.where(done, torch.full_like(token, eos_id), token)
                done |= token == eos_id
            out = torch.cat([out, token[:, None]], dim=1)
            if eos_id is not None and bool(done.all()):
                break
            logits, state = self(token[:, None], state)
        return out


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of logits [B, V]: greedy at temperature 0, else sampled from the tempered
    distribution restricted to the top_k tokens and to the smallest set whose probability reaches top_p."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)

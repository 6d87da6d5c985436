"""The backbone shared by every mixer (MesaNet paper, App. E): embedding, blocks of pre-RMSNorm mixer and
pre-RMSNorm SwiGLU MLP with residuals, a final norm, a tied head with an optional logit soft cap. Its shape, LMConfig,
is lm.model_config's, which parses and checks without torch; `from lm.model import LMConfig` finds it here too."""

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from lm.mixers import MIXERS
from lm.mixers.context_parallel import ContextGroup, mix_in_context
from lm.mixers.layers import residual_output
from lm.model_config import LMConfig
from lm.ops.cross_entropy import head_cross_entropy
from lm.util.errors import UserError


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

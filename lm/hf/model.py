"""`LMForCausalLM`: an lm model as a transformers PreTrainedModel, for the tools built on transformers (lm-eval's
`hf` model, generation pipelines). It wraps `LanguageModel` and adds only what transformers expects around it: the
causal-LM output with its loss, an `LMCache` for `generate()`, and left padding."""

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from lm.hf.cache import LMCache
from lm.hf.config import LMHFConfig
from lm.model import LanguageModel, LMConfig


def padding_resets(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """reset [B, T] at the first real token of each row that has padding before it (None when no row has any).

    A reset empties every mixer's state there, so a left-padded row is computed as if it started at its first real
    token: attention masks the pads and restarts RoPE positions, a recurrent state forgets them. Right padding (pads
    after the real tokens) changes no real token's output and needs nothing. Pads between real tokens are refused."""
    mask = attention_mask.bool()
    real = mask.long().cumsum(dim=1)
    first = mask & (real == 1)
    last_real = real == real[:, -1:]
    if bool((~mask & (real > 0) & ~last_real).any()):
        raise ValueError("attention_mask has padding between real tokens; lm models take left or right padding only")
    left_padded = ~mask[:, :1] & mask.any(dim=1, keepdim=True)
    return (first & left_padded) if bool(left_padded.any()) else None


class LMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LMHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: LMHFConfig):
        super().__init__(config)
        self.model = LanguageModel(LMConfig(**config.lm))
        self.post_init()

    def _init_weights(self, module):
        """LanguageModel's own initialisation (each mixer knows its paper's), for a model made from a config."""
        if isinstance(module, LanguageModel):
            module.reset_parameters()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward makes the LMCache itself: a DynamicCache holds keys and values only

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head  # None when the head is the embedding itself

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                cache: LMCache | None = None, labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """Logits [B, T, vocab] of input_ids [B, T], continuing `cache` (an LMCache) when given.

        attention_mask [B, past + T]: left padding is honoured (see padding_resets); after the first call only new
        real tokens may come. labels [B, T]: the mean next-token cross-entropy over labels other than -100."""
        if inputs_embeds is not None:
            raise ValueError("lm models take input_ids, not inputs_embeds")
        if cache is not None and not isinstance(cache, LMCache):
            raise ValueError(f"lm models carry their state in an LMCache, not a {type(cache).__name__}")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        past = cache.states() if cache is not None else None
        reset = None
        if attention_mask is not None:
            new = attention_mask[:, -input_ids.shape[1]:]
            if past is None:
                reset = padding_resets(new)
            elif not bool(new.all()):
                raise ValueError("after the first call, attention_mask may only add real tokens (1s)")
        separator = self.model.cfg.document_separator
        if reset is not None and separator is not None:  # the model's own resets at each document's start
            reset = reset | (input_ids == separator)
        logits, states = self.model(input_ids, past, reset)
        if use_cache:
            cache = cache if cache is not None else LMCache(len(self.model.blocks))
            cache.store(states, input_ids.shape[1])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      num_items_in_batch=kwargs.get("num_items_in_batch"))
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

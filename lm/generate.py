"""`lm generate`: sample a continuation of a prompt from a checkpoint, decoding with the carried state."""

import torch

from lm.data_prep.tokenizer import separator
from lm.training.checkpoint import load_with_tokenizer
from lm.util.errors import UserError


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Settings that sample nothing sensible fail before the checkpoint is loaded (a negative temperature would
    silently favour the least likely tokens)."""
    if max_new_tokens < 0:
        raise UserError(f"--max_new_tokens must be at least 0, got {max_new_tokens}")
    if not temperature >= 0:
        raise UserError(f"--temperature must be at least 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top_k must be at least 1 (or null: all tokens), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"--top_p must lie in (0, 1] (or null: all tokens), got {top_p}")


def generate_text(checkpoint: str, prompt: str = "", max_new_tokens: int = 64, temperature: float = 0.8,
                  top_k: int | None = 50, top_p: float | None = 0.95, seed: int = 0) -> str:
    """Continue `prompt` with tokens sampled from the model of a checkpoint.

    Args:
        checkpoint: A checkpoint file, a run directory (its newest checkpoint) or an `lm export` directory.
        prompt: Text to continue; documents start after the separator token, so an empty prompt starts one.
        max_new_tokens: Upper bound on generated tokens.
        temperature: Sampling temperature; 0 is greedy.
        top_k: Sample among the k most likely tokens (None: all).
        top_p: Sample among the smallest set of tokens whose probability reaches p (None: all).
        seed: Seed of the sampler.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    model, tokenizer = load_with_tokenizer(checkpoint)
    _, sep = separator(tokenizer)
    ids = [sep] + tokenizer.encode(prompt, add_special_tokens=False).ids
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([ids]), max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         eos_id=sep, generator=generator)
    new = [t for t in out[0, len(ids):].tolist() if t != sep]
    return prompt + tokenizer.decode(new)

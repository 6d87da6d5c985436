"""`lm generate`: sample a continuation of a prompt from a checkpoint, decoding with the carried state.

Past the model's max_seq_len (here: the prompt and --max_new_tokens; in `lm eval ppl`: a window) a command says so in
one line, a warning and not a refusal: every mixer of lm runs at any length (attention computes its rotary angles
for any position, with no table to run out of; SWA keeps its window; a recurrent mixer carries a state of one size
and has no position at all), so nothing fails or is cut; but no layer was trained there, and what comes out measures
length extrapolation (attention sees distances it never saw, a recurrent state runs longer than it ever did).
"""

import sys
from typing import TYPE_CHECKING

import torch

from lm.data_prep.tokenizer import separator
from lm.training.checkpoint import load_with_tokenizer
from lm.util.errors import UserError

if TYPE_CHECKING:
    from lm.model import LMConfig


def past_max_seq_len(cfg: "LMConfig", length: int, reaching: str) -> str | None:
    """One line when `length` tokens at once are past the max_seq_len of a model of `cfg` (None within it):
    `reaching` says what reaches them ("windows of"). A warning, never a refusal (the module's docstring)."""
    from lm.model_config import mixer_counts  # `lm generate --help` need not import it

    if length <= cfg.max_seq_len:
        return None
    return (f"warning: {reaching} {length} tokens, past the model's max_seq_len {cfg.max_seq_len}: its layers "
            f"({mixer_counts(cfg.layer_mixers())}) run at any length but were never trained past "
            f"{cfg.max_seq_len} tokens, so what comes after measures length extrapolation")


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
        max_new_tokens: Upper bound on generated tokens (past the model's max_seq_len, with the prompt: a warning,
            as the module's docstring says).
        temperature: Sampling temperature; 0 is greedy.
        top_k: Sample among the k most likely tokens (None: all).
        top_p: Sample among the smallest set of tokens whose probability reaches p (None: all).
        seed: Seed of the sampler.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    model, tokenizer = load_with_tokenizer(checkpoint)
    _, sep = separator(tokenizer)
    ids = [sep] + tokenizer.encode(prompt, add_special_tokens=False).ids
    reaching = f"the prompt ({len(ids)} tokens, its separator included) and --max_new_tokens {max_new_tokens} reach"
    if warning := past_max_seq_len(model.cfg, len(ids) + max_new_tokens, reaching):
        print(f"lm generate: {warning}", file=sys.stderr)
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([ids]), max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         eos_id=sep, generator=generator)
    new = [t for t in out[0, len(ids):].tolist() if t != sep]
    return prompt + tokenizer.decode(new)

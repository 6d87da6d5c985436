"""`lm bench hf-generate`: decoding through transformers' `generate()` (lm/hf) against `LanguageModel.generate`, per
mixer: the LMCache's bytes after the prompt and after every generated token, and the two loops' tokens/s as a ratio
taken in one run. Random weights: the figures are about the loop and the state, not the text."""

import json
import tempfile
import time
from pathlib import Path

import torch

from lm.bench.progress import each_run
from lm.bench.train_speed import device_name
from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig
from lm.util.errors import UserError
from lm.util.output import write_json


def greedy_seconds(generate, repeats: int) -> float:
    """The best of `repeats` timings of generate() (the first call warms up and is not counted)."""
    generate()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        generate()
        best = min(best, time.perf_counter() - start)
    return best


def measure(cfg: LMConfig, prompt: int, tokens: int, repeats: int) -> dict:
    """One model of random weights, loaded back through AutoModelForCausalLM as any tool built on it would."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from lm.hf.export import save_hf

    torch.manual_seed(0)
    model = LanguageModel(cfg).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf = AutoModelForCausalLM.from_pretrained(save_hf(model.state_dict(), cfg, folder, None)).eval()
    ids = torch.randint(1, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    settings = GenerationConfig(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    sizes = []  # LMCache bytes after each forward call: the prompt, then one call per generated token
    hook = hf.register_forward_hook(lambda module, args, out: sizes.append(out.cache.nbytes()))
    out = hf.generate(ids, generation_config=settings)
    hook.remove()
    hf_s = greedy_seconds(lambda: hf.generate(ids, generation_config=settings), repeats)
    lm_s = greedy_seconds(lambda: model.generate(ids, tokens, temperature=0), repeats)
    return {"cache_bytes_after_prompt": sizes[0], "cache_bytes_at_end": sizes[-1],
            "bytes_per_generated_token": (sizes[-1] - sizes[0]) / (len(sizes) - 1),
            "same_tokens": out.tolist() == model.generate(ids, tokens, temperature=0).tolist(),
            "hf_tokens_per_s": tokens / hf_s, "lm_tokens_per_s": tokens / lm_s, "hf_over_lm_time": hf_s / lm_s}


def bench_hf_generate(mixers: list[str] | None = None, prompt: int = 64, tokens: int = 256, d_model: int = 256,
                      n_layers: int = 2, n_heads: int = 4, head_dim: int = 64, vocab_size: int = 4096,
                      repeats: int = 2, json_out: str | None = None) -> dict:
    """Greedy decoding of `tokens` tokens after a `prompt`-token prompt, batch 1, per mixer.

    Args:
        mixers: Mixer of every layer, one model per mixer (default: all).
        prompt, tokens: Prompt length and tokens generated.
        d_model, n_layers, n_heads, head_dim, vocab_size: The model's shape.
        repeats: Timed runs of each loop (the best is kept).
        json_out: Also write the result as JSON to this path.
    """
    mixers = list(MIXERS) if mixers is None else mixers
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown or min(prompt, tokens, repeats) < 1:
        raise UserError(f"mixers must be among {', '.join(sorted(MIXERS))} (unknown: {unknown}); prompt, tokens and "
                        "repeats must be >= 1")
    rows = []
    for mixer in each_run(mixers, "lm bench hf-generate"):
        cfg = LMConfig(mixer=mixer, d_model=d_model, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim,
                       vocab_size=vocab_size, max_seq_len=prompt + tokens)
        rows.append({"mixer": mixer, **measure(cfg, prompt, tokens, repeats)})
        print(json.dumps(rows[-1]))
    result = {"device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(), "prompt": prompt,
              "tokens": tokens, "shape": {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads,
                                          "head_dim": head_dim, "vocab_size": vocab_size}, "rows": rows}
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        write_json(json_out, result)
    return result

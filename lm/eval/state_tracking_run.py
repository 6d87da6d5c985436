"""One run of `lm eval state-tracking`: a small model trained on one word problem at one seed and lr, its learning
curve, an early stop once it has solved the training length, and its accuracy at every position of longer words.

Training: AdamW, a linear warmup then a cosine decay to zero at max_steps, fresh words every step, every position
scored. Every eval_every steps the learning curve gains a point: the training loss over those steps and the
validation words' loss and accuracy at the training length (the last position's, and the share of words right at
every position). The validation words are drawn once, from a seed of their own (VAL_SEED), the same for every run of
a task; once the share right at every position reaches solved_at the run stops. A loss that is not finite ends the
run (a high lr of a sweep may diverge), marked diverged.

Test: fresh words of the longest multiple of the training length, each position scored: `token`, the share of words
whose running product the model predicts at that position; `prefix`, the share it predicts right at every position up
to there (the papers' sequence accuracy by length). A causal model's prediction at position t reads only the first t
elements, so position m x length of these words is the last position of a word of m x length.
"""

import dataclasses
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from lm.eval.state_tracking_words import group, words
from lm.mixers import MIXERS, MixerOptionError
from lm.model import LanguageModel, LMConfig
from lm.util.errors import UserError

VAL_SEED = 20_241_119  # the validation words' own seed, apart from every run's
TEST_SEED_OFFSET = 10_000  # a run's test words: seed + this, apart from its training words


def option_value(text: str):
    """A variant's option as written after `=`: JSON (a number, true/false, null, a list), else a word."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_model(spec: str) -> tuple[str, dict, int | None]:
    """(mixer, options, layers or None) of "mixer" or "mixer@option=value@...", the options checked against the
    mixer's Options; "@layers=N" sets the model's depth."""
    mixer, *items = spec.split("@")
    if mixer not in MIXERS:
        raise UserError(f"--models: unknown mixer {mixer!r} in {spec!r}; known: {', '.join(MIXERS)}")
    options, layers = {}, None
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise UserError(f"--models: {item!r} in {spec!r} is not OPTION=VALUE")
        if key == "layers":
            layers = option_value(text)
            if not isinstance(layers, int) or layers < 1:
                raise UserError(f"--models: layers in {spec!r} must be a whole number of at least 1")
            continue
        options[key] = option_value(text)
    try:
        MIXERS[mixer].check_options(options)
    except MixerOptionError as err:
        raise UserError(f"--models: {spec}: {err}") from None
    return mixer, options, layers


def build(task: str, spec: str, d_model: int, n_layers: int, n_heads: int, head_dim: int, mlp_ratio: float,
          max_len: int, task_options: dict | None = None) -> LanguageModel:
    """The model of `spec` for `task`; `task_options` given to its mixer where it has them (the spec's own win)."""
    mixer, options, layers = parse_model(spec)
    fields = {f.name for f in dataclasses.fields(MIXERS[mixer].Options)}
    options = {k: v for k, v in (task_options or {}).items() if k in fields} | options
    return LanguageModel(LMConfig(vocab_size=len(group(task)[1]), d_model=d_model, n_layers=layers or n_layers,
                                  n_heads=n_heads, head_dim=head_dim, mixer=mixer, mixer_options={mixer: options},
                                  max_seq_len=max_len, logit_soft_cap=None, mlp_ratio=mlp_ratio))


def warmup_cosine(warmup_steps: int, total: int):
    """The lr factor at a step: linear from 1 / warmup_steps to 1, then a cosine to 0 at `total`."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))))
    return factor


def validate(model: LanguageModel, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Loss and accuracy at the training length on fixed words: the last position's, and the share of words right
    at every position."""
    model.eval()
    with torch.no_grad():
        logits, _ = model(x)
    model.train()
    right = logits.argmax(-1) == y
    return {"val_loss": F.cross_entropy(logits.flatten(0, 1), y.flatten()).item(),
            "val_last": right[:, -1].float().mean().item(), "val_word": right.all(1).float().mean().item()}


def position_scores(right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From right [words, length] (whether each prediction is the running product), per position: how many words are
    right there, and how many are right at every position up to there."""
    return right.float().sum(0), right.long().cumprod(1).float().sum(0)


def accuracy_by_position(model: LanguageModel, task: str, length: int, count: int, generator: torch.Generator,
                         batch: int = 128) -> dict[str, list[float]]:
    """Over `count` fresh words of `length`, at each position: `token`, the share whose running product the model
    predicts there; `prefix`, the share it predicts right at every position up to there."""
    token, prefix = torch.zeros(length), torch.zeros(length)
    model.eval()
    with torch.no_grad():
        for start in range(0, count, batch):
            x, y = words(task, min(batch, count - start), length, generator)
            right_here, right_so_far = position_scores(model(x)[0].argmax(-1) == y)
            token += right_here
            prefix += right_so_far
    return {"token": (token / count).tolist(), "prefix": (prefix / count).tolist()}


def train_one(task: str, spec: str, seed: int, lr: float, length: int, max_steps: int, batch: int, d_model: int,
              n_layers: int, n_heads: int, head_dim: int, mlp_ratio: float, warmup: float, weight_decay: float,
              grad_clip: float | None, eval_every: int, val_words: int, solved_at: float, test_words: int,
              multiples: list[int], options: dict | None = None, name: str | None = None) -> dict:
    """Train `spec` on `task` at `seed` and `lr`; its learning curve, where it stopped and why, and its test accuracy
    by position (module docstring). `options`: the task's mixer options (build). `name`: print a progress line at
    every point of the curve (stderr)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    model = build(task, spec, d_model, n_layers, n_heads, head_dim, mlp_ratio, length * max(multiples), options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(max(1, round(warmup * max_steps)),
                                                                          max_steps))
    data = torch.Generator().manual_seed(seed)
    val_x, val_y = words(task, val_words, length, torch.Generator().manual_seed(VAL_SEED))
    curve, losses, solved, diverged, step = [], [], None, False, 0
    while step < max_steps and solved is None and not diverged:
        step += 1
        x, y = words(task, batch, length, data)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if not torch.isfinite(loss):
            diverged = True
            break
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.item())
        if step % eval_every == 0 or step == max_steps:
            point = {"step": step, "train_loss": sum(losses) / len(losses), **validate(model, val_x, val_y)}
            curve.append(point)
            losses.clear()
            if point["val_word"] >= solved_at:
                solved = step
            if name is not None:
                print(f"lm eval state-tracking: {name} lr {lr:g}: step {step}/{max_steps}, loss "
                      f"{point['train_loss']:.3f}, val {point['val_last']:.0%} last, {point['val_word']:.0%} whole "
                      f"words ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    test = torch.Generator().manual_seed(seed + TEST_SEED_OFFSET)
    by_position = accuracy_by_position(model, task, length * max(multiples), test_words, test)
    at = {str(m): m * length - 1 for m in multiples}  # the last position of a word of m x length
    return {"task": task, "model": spec, "seed": seed, "lr": lr, "length": length, "max_steps": max_steps,
            "steps": step, "solved_step": solved, "diverged": diverged, "curve": curve,
            "final_loss": curve[-1]["train_loss"] if curve else None,
            "accuracy": {m: by_position["token"][i] for m, i in at.items()},
            "word_accuracy": {m: by_position["prefix"][i] for m, i in at.items()},
            "by_position": {k: [round(v, 4) for v in values] for k, values in by_position.items()},
            "params": model.num_params(), "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu_start}

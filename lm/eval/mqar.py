"""Multi-query associative recall (MQAR, Arora et al. 2023 "Zoology"), generated locally and seeded.

A sequence lists n key-value pairs, then asks for the keys again in a random order, each query followed by a
filler token; the model must answer each query with its value. Keys come from the lower half of the vocabulary
(1 .. vocab/2 - 1; 0 is the filler), values from the upper half; only the answer positions are scored.
With a fixed `length` (zoology's format, used by lm/eval/mqar_grid.py) the queries sit at random positions of the
rest of the sequence, and every other position there holds the filler.
`train_mqar` trains a small model of one mixer on it and reports accuracy.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lm.mixers import MIXERS
from lm.mixers.protocol import at_length
from lm.model import LanguageModel, LMConfig
from lm.util.errors import UserError
from lm.util.output import write_json

# What `lm eval mqar`'s default task (vocab 32, 4 pairs, 2 layers, d_model 64) gives each mixer, where it is not the
# default for a mixer not listed here: training steps (each a minute or less on 2 CPU cores), peak learning rate, and
# options other than the mixer's own defaults (docs/mqar.md).
DEFAULT_STEPS, DEFAULT_LR = 1000, 3e-3
STEPS = {
    "attention": 1500,  # an induction circuit over its two layers forms after ~500 steps
    "swa": 1500,  # attention within its window, which covers these sequences
    "mamba2": 1500,  # binds a key to its value slowly, and by seed: 1000 steps were not enough at seed 0 (docs/mqar.md)
    "mlstm": 500,
    "deltanet": 300, "gated_deltanet": 300, "gla": 300, "mesa": 300, "kda": 300, "precond_gated_deltanet": 300,
    # Gated DeltaProduct (2 steps a token, beta in [0, 2]) binds by seed: at 300 steps seed 4 of 0-4 was at 57%, at 500
    # every seed at 99.7-100.0% (docs/mqar.md).
    "gated_deltaproduct": 500,
    # With Griffin's initialisation (a conv of std 0.05, decays from 0.66 to 0.996) Hawk stays near 34% at lr 3e-3
    # for 3000 steps; at 1e-2, 77% after 1000 steps and 96% after 2000 (seed 0, docs/mqar.md).
    "hawk": 2000,
}
LRS = {"hawk": 1e-2}
OPTIONS = {
    # fla's short convolution: the paper's block (none) learns this MQAR for one seed in three (docs/mqar.md).
    "gla": {"conv_size": 4},
    # The short convolution of the first xLSTM paper's block: xLSTM 7B's block (the default, no convolution) stays
    # near 35% on MQAR, with it 96-99% (docs/mqar.md).
    "mlstm": {"conv_size": 4},
}


def steps_for(mixer: str) -> int:
    """Training steps of `lm eval mqar`'s default task for `mixer`."""
    return STEPS.get(mixer, DEFAULT_STEPS)


def lr_for(mixer: str) -> float:
    """Peak learning rate of `lm eval mqar`'s default task for `mixer`."""
    return LRS.get(mixer, DEFAULT_LR)


def options_for(mixer: str) -> dict:
    """The options `lm eval mqar` gives `mixer` beside its defaults (none for most)."""
    return dict(OPTIONS.get(mixer, {}))


@dataclass
class MQARTask:
    vocab: int = 128
    pairs: int = 8
    queries: int | None = None  # default: every key once
    length: int | None = None  # fixed input length (zoology's format); None: context then `query 0` pairs
    # With a fixed length, where the queries go after the context: "uniform" (any free position), or zoology's
    # "power" law: query j at 2 g_j after the context, the distinct gaps g drawn with P(g) ~ (g + 1)^(power_a - 1),
    # so most queries come soon after the context (zoology's data/multiquery_ar.py, a = 0.01).
    gaps: str = "uniform"
    power_a: float = 0.01
    random_fill: bool = False  # the positions between queries hold random tokens (zoology), not the filler 0

    def __post_init__(self):
        n, m = self.pairs, self.queries or self.pairs
        if n > self.vocab // 2 - 1:
            raise ValueError(f"{n} pairs need {n} distinct keys; vocab {self.vocab} has {self.vocab // 2 - 1} "
                             f"(1 .. vocab/2 - 1)")
        if self.length is not None and 2 * n + m > self.length:
            raise ValueError(f"{n} pairs and {m} queries need 2 x {n} + {m} = {2 * n + m} tokens; "
                             f"length is {self.length}")
        if self.gaps not in ("uniform", "power"):
            raise ValueError(f"gaps must be uniform or power, got {self.gaps!r}")
        if self.gaps == "power" and (self.length is None or 2 * n + 2 * m > self.length or self.power_a <= 0):
            raise ValueError(f"power-law gaps put each query 2 g after the context: {n} pairs and {m} queries need a "
                             f"length of 2 x {n} + 2 x {m} = {2 * n + 2 * m} or more (got {self.length}), and "
                             f"power_a > 0 (got {self.power_a})")

    @property
    def seq_len(self) -> int:
        return self.length or 2 * self.pairs + 2 * (self.queries or self.pairs)


def mqar_batch(task: MQARTask, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [B, L], targets [B, L]) with targets -100 except where a queried key's value is to be predicted.

    As in zoology, the answers are targets only, never inputs: each query key is followed by the filler token 0
    (never a key), not by its value. Shown answers would let a model score on later queries by ruling out the
    values already given, without binding keys to values at all (Mamba2 and mLSTM settled there, near 57%).
    """
    half, n, m = task.vocab // 2, task.pairs, task.queries or task.pairs
    keys = torch.stack([torch.randperm(half - 1, generator=generator)[:n] + 1 for _ in range(batch)])
    values = torch.randint(half, task.vocab, (batch, n), generator=generator)
    asked = torch.stack([torch.randperm(n, generator=generator)[:m] for _ in range(batch)])
    context = torch.stack([keys, values], dim=2).flatten(1)  # k1 v1 k2 v2 ...
    query_keys = keys.gather(1, asked)
    if task.length is not None:  # zoology: the queries at positions after the context, filler elsewhere
        if task.gaps == "power":
            space = (task.length - 2 * n) // 2
            weight = torch.arange(1, space + 1, dtype=torch.float64) ** (task.power_a - 1)
            gaps = torch.multinomial(weight.expand(batch, space), m, replacement=False, generator=generator)
            where = 2 * n + 2 * gaps
        else:
            where = 2 * n + torch.rand(batch, task.length - 2 * n, generator=generator).argsort(1)[:, :m]
        inputs = (torch.randint(0, task.vocab, (batch, task.length), generator=generator) if task.random_fill else
                  torch.zeros(batch, task.length, dtype=torch.long))
        inputs[:, :2 * n] = context
        inputs.scatter_(1, where, query_keys)
        targets = torch.full_like(inputs, -100).scatter_(1, where, values.gather(1, asked))
        return inputs, targets
    tail = torch.stack([query_keys, torch.zeros_like(query_keys)], dim=2).flatten(1)  # q1 0 q2 0 ...
    inputs = torch.cat([context, tail], dim=1)[:, :-1]
    targets = torch.full_like(inputs, -100)
    targets[:, 2 * n::2] = values.gather(1, asked)  # the position of each query key predicts its answer
    return inputs, targets


def accuracy(model: LanguageModel, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        logits, _ = model(inputs)
    scored = targets != -100
    return (logits.argmax(-1)[scored] == targets[scored]).float().mean().item()


def state_floats(model: LanguageModel, length: int) -> int:
    """Numbers the model carries per sequence after `length` tokens, all layers (recurrent memories, conv buffers,
    or attention's KV cache, which grows with the length)."""
    with torch.no_grad():
        _, state = model(torch.zeros(1, length, dtype=torch.long))
    tensors, stack = [], [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(t.numel() for t in tensors)


def state_floats_per_layer(model: LanguageModel, length: int) -> int:
    """`state_floats` of one layer (the mean over layers: a hybrid's layers differ)."""
    return state_floats(model, length) // len(model.blocks)


def train_mqar(mixer: str, task: MQARTask = MQARTask(), d_model: int = 64, n_layers: int = 2, n_heads: int = 2,
               head_dim: int = 32, steps: int = 400, batch: int = 64, lr: float = 3e-3, seed: int = 0,
               mixer_options: dict | None = None, eval_batches: int = 4) -> dict:
    """Train a small model of `mixer` on MQAR with AdamW + cosine decay; return accuracy on fresh sequences."""
    torch.manual_seed(seed)
    cfg = LMConfig(vocab_size=task.vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim,
                   mixer=mixer, mixer_options={mixer: mixer_options or {}}, max_seq_len=task.seq_len,
                   logit_soft_cap=None, mlp_ratio=2.0)
    model = LanguageModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1)
    data = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(steps):
        inputs, targets = mqar_batch(task, batch, data)
        logits, _ = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    test = torch.Generator().manual_seed(seed + 10_000)
    model.eval()
    acc = sum(accuracy(model, *mqar_batch(task, batch, test)) for _ in range(eval_batches)) / eval_batches
    return {"mixer": mixer, "options": mixer_options or {}, "accuracy": acc, "final_loss": loss.item(),
            "params": model.num_params(), "state_floats": state_floats(model, task.seq_len), "steps": steps, "lr": lr,
            "seconds": time.perf_counter() - start}


def mqar_table(mixers: list[str] | None = None,
               vocab: int = 32, pairs: int = 4, steps: int | None = None, batch: int = 64, lr: float | None = None,
               d_model: int = 64, n_heads: int = 2, head_dim: int = 32, seed: int = 0,
               mixer_options: dict[str, dict] | None = None, json_out: str | None = None) -> list[dict]:
    """Train a 2-layer model of each mixer on MQAR and print their accuracies side by side.

    Args:
        mixers: Mixers to compare (default: every registered mixer).
        vocab: Vocabulary (keys from the lower half, values from the upper half).
        pairs: Key-value pairs per sequence (each is queried once).
        steps: Training steps per model (default: per mixer, STEPS in lm/eval/mqar.py; 1000 for others).
        batch: Sequences per step (fresh ones every step).
        lr: Peak learning rate (one-cycle schedule; default: per mixer, LRS in lm/eval/mqar.py; 3e-3 for others).
        d_model: Width.
        n_heads: Heads.
        head_dim: Key size per head.
        seed: Seed of the model and the data.
        mixer_options: Options per mixer, instead of its OPTIONS in lm/eval/mqar.py (e.g. {mlstm: {conv_size: 0}} for
            xLSTM 7B's block as it is).
        json_out: Also write the rows as JSON here.
    """
    mixers = list(MIXERS) if mixers is None else mixers
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown:
        raise UserError(f"unknown mixers {unknown}; known: {', '.join(MIXERS)}")
    if pairs < 1 or batch < 1 or (steps is not None and steps < 1):
        raise UserError(f"--pairs, --batch and --steps must be at least 1, got {pairs}, {batch} and {steps}")
    if lr is not None and not lr > 0:
        raise UserError(f"--lr must be positive, got {lr}")
    try:
        task = MQARTask(vocab=vocab, pairs=pairs)
    except ValueError as err:
        raise UserError(f"--pairs {pairs}: {err}") from None
    if json_out is not None and (Path(json_out).is_dir() or not Path(json_out).resolve().parent.is_dir()):
        raise UserError(f"--json_out {json_out}: not a file in an existing folder")
    options = {m: at_length(m, (mixer_options or {}).get(m, options_for(m)), task.seq_len) for m in mixers}
    for m in mixers:  # the shape and options of every model, before the first one trains
        LMConfig(vocab_size=vocab, d_model=d_model, n_layers=2, n_heads=n_heads, head_dim=head_dim, mixer=m,
                 mixer_options={m: options.get(m) or {}}, max_seq_len=task.seq_len)
    rows = [train_mqar(m, task, d_model=d_model, n_heads=n_heads, head_dim=head_dim,
                       steps=steps or steps_for(m), batch=batch, lr=lr or lr_for(m), seed=seed,
                       mixer_options=options.get(m))
            for m in mixers]
    print(f"MQAR: vocab {vocab}, {pairs} pairs, length {task.seq_len}, 2 layers, d {d_model}, batch {batch}, "
          f"lr {lr or ', '.join(f'{m} {lr_for(m):g}' for m in mixers)}")
    print("| mixer | options | params | state floats | steps | accuracy | final loss | seconds |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mixer']} | {r['options'] or '-'} | {r['params']:,} | {r['state_floats']:,} | {r['steps']} "
              f"| {r['accuracy']:.1%} | {r['final_loss']:.3f} | {r['seconds']:.0f} |")
    if json_out:
        write_json(json_out, rows)
        print(f"lm eval mqar: wrote {json_out}", file=sys.stderr)
    return rows

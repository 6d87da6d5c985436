"""Long-context probes generated here, seeded, with nothing downloaded (after RULER, Hsieh et al. 2024).

- needle in a haystack: `single` (one needle), `multikey` (the asked needle among needles of other keys),
  `multivalue` (several values of one key, all asked); the haystack is repeated noise sentences or text of the
  bundled corpus; the asked needle sits at a given depth (0 = start, 1 = end of the haystack).
- `passkey` (Mohtashami & Jaggi 2023): one five-digit pass key, stated twice, in a noise or corpus haystack;
  the question repeats the statement's words, so copying (an induction head) answers it.
- `mqar` (multi-query associative recall, after Zoology): many key-value needles; several keys asked at once,
  every value must come back.
- variable tracking (`vt`): a chain VAR A = 12345, VAR B = VAR A, ... spread over the haystack; asked: every
  variable that holds the value.

Each example is {prompt, answers, depth, needle_depth}: the model should continue the prompt with every answer.
Lengths count the model's tokens.
"""

import gzip
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer

from lm.util.errors import UserError

PROBES = ("passkey", "single", "multikey", "multivalue", "mqar", "vt")
HAYSTACKS = ("noise", "corpus")
NOISE = ["The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. ",
         "There and back again. "]
KEYS = ["apple", "river", "candle", "meadow", "lantern", "harbor", "violin", "pepper", "glacier", "saddle",
        "thimble", "orchid", "falcon", "quarry", "marble", "tundra", "walnut", "beacon", "cobalt", "ember"]
PASSKEY_INTRO = ("There is a pass key hidden in the following text. Find it and remember it; I will ask you for "
                 "it afterwards.\n")
INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the numbers afterwards.\n")


@dataclass
class Example:
    prompt: str
    answers: list[str]
    depth: float  # asked for
    needle_depth: float  # where the asked needle landed: haystack tokens before it / haystack tokens


@lru_cache(maxsize=1)
def corpus_sentences() -> list[str]:
    from lm.data_prep.prepare import BUNDLED_CORPUS

    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        text = " ".join(json.loads(line)["text"] for line in f)
    return [s.strip() + " " for s in re.split(r"(?<=[.;:?!])\s+", text) if s.strip()]


def haystack(kind: str, n_tokens: int, tokenizer: Tokenizer, rng: random.Random) -> tuple[list[str], list[int]]:
    """Sentences of about n_tokens tokens in all, and each one's token count."""
    if kind not in HAYSTACKS:
        raise UserError(f"haystack {kind!r} is not one of {', '.join(HAYSTACKS)}")
    source = NOISE if kind == "noise" else corpus_sentences()
    start = 0 if kind == "noise" else rng.randrange(len(source))
    sentences, counts, total = [], [], 0
    while total < n_tokens:
        sentence = source[(start + len(sentences)) % len(source)]
        count = len(tokenizer.encode(sentence, add_special_tokens=False).ids)
        sentences.append(sentence)
        counts.append(count)
        total += count
    return sentences, counts


def place(sentences: list[str], counts: list[int], insertions: list[tuple[float, str, int]]) -> tuple[str, float]:
    """The haystack with each (depth, sentence, token count) inserted at the sentence boundary nearest its depth;
    and the depth, in tokens, at which the first insertion landed."""
    total = sum(counts)
    boundaries = [0]
    for count in counts:
        boundaries.append(boundaries[-1] + count)
    slots: dict[int, list[str]] = {}
    landed = 0.0
    for i, (depth, sentence, _) in enumerate(insertions):
        slot = min(range(len(boundaries)), key=lambda b: abs(boundaries[b] - depth * total))
        slots.setdefault(slot, []).append(sentence)
        if i == 0:
            landed = boundaries[slot] / total
    text = "".join("".join(slots.get(b, [])) + (sentences[b] if b < len(sentences) else "")
                   for b in range(len(boundaries)))
    return text, landed


def make_example(probe: str, tokenizer: Tokenizer, length: int, depth: float, seed: int,
                 haystack_kind: str = "noise", n_needles: int = 4) -> Example:
    """One example of `probe`, about `length` tokens long, its asked needle at `depth`; the same arguments give
    the same example."""
    if probe not in PROBES:
        raise UserError(f"probe {probe!r} is not one of {', '.join(PROBES)}")
    if not 0 <= depth <= 1:
        raise UserError(f"depth must lie in [0, 1], not {depth}")
    rng = random.Random(f"{probe}/{haystack_kind}/{length}/{depth}/{seed}")
    keys = rng.sample(KEYS, n_needles)
    number = lambda: str(rng.randint(1_000_000, 9_999_999))  # noqa: E731
    intro = INTRO
    if probe == "passkey":
        intro, key = PASSKEY_INTRO, str(rng.randint(10_000, 99_999))
        needles, answers, depths = [f"The pass key is {key}. Remember it. {key} is the pass key. "], [key], [depth]
        question = "\nWhat is the pass key? The pass key is"
    elif probe == "mqar":
        values = [number() for _ in keys]
        needles = [f"The number for {k} is {v}. " for k, v in zip(keys, values)]
        asked = rng.sample(range(len(keys)), max(1, len(keys) // 2))
        answers = [values[i] for i in asked]
        # The first asked needle sits at `depth`, the others anywhere.
        depths = [rng.random() for _ in keys]
        depths[asked[0]] = depth
        order = [asked[0]] + [i for i in range(len(keys)) if i != asked[0]]
        needles, depths = [needles[i] for i in order], [depths[i] for i in order]
        names = ", ".join(keys[i] for i in asked[:-1]) + (" and " if len(asked) > 1 else "") + keys[asked[-1]]
        question = f"\nWhat are the numbers for {names}? The numbers for {names} are"
    elif probe == "vt":
        names = ["".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)) for _ in range(n_needles)]
        value = number()
        needles = [f"VAR {names[0]} = {value}. "] + [f"VAR {b} = VAR {a}. " for a, b in zip(names, names[1:])]
        answers = names
        question = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
                    f"Answer: According to the chain of variable assignments in the text above, {len(names)} "
                    f"variables are assigned the value {value}, they are:")
        # The chain starts at `depth` and its later links follow in order over the rest of the haystack.
        depths = [depth + (1 - depth) * i / len(needles) for i in range(len(needles))]
    else:
        asked = keys[0]
        if probe == "multivalue":
            values = [number() for _ in range(n_needles)]
            needles = [f"One of the special magic numbers for {asked} is: {v}. " for v in values]
            answers = values
            depths = [depth] + [rng.random() for _ in values[1:]]
        else:
            others = keys[1:] if probe == "multikey" else []
            values = [number() for _ in range(1 + len(others))]
            needles = [f"One of the special magic numbers for {k} is: {v}. " for k, v in zip([asked] + others, values)]
            answers = values[:1]
            depths = [depth] + [rng.random() for _ in others]
        what = "all the special magic numbers" if probe == "multivalue" else "the special magic number"
        question = (f"\nWhat is {what} for {asked} mentioned in the provided text? "
                    f"The special magic number{'s' if probe == 'multivalue' else ''} for {asked} mentioned in the "
                    f"provided text {'are' if probe == 'multivalue' else 'is'}")
    encode = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    fixed = encode(intro) + encode(question) + sum(encode(n) for n in needles) + 1  # + the separator
    if length - fixed < 16:
        raise UserError(f"length {length} leaves no room for a haystack (the probe alone is {fixed} tokens)")
    budget, state = length - fixed, rng.getstate()
    for _ in range(4):  # tokens merge across sentence boundaries: shrink the budget until the prompt fits
        rng.setstate(state)
        sentences, counts = haystack(haystack_kind, budget, tokenizer, rng)
        text, landed = place(sentences, counts, [(d, n, encode(n)) for d, n in zip(depths, needles)])
        excess = encode(intro + text + question) + 1 - length
        if excess <= 0:
            break
        budget -= excess
    while excess > 0 and len(sentences) > 1:  # still over: drop sentences from the end until it fits
        sentences, counts = sentences[:-1], counts[:-1]
        text, landed = place(sentences, counts, [(d, n, encode(n)) for d, n in zip(depths, needles)])
        excess = encode(intro + text + question) + 1 - length
    return Example(intro + text + question, answers, depth, landed)


def score(output: str, answers: list[str]) -> float:
    """The fraction of the answers that the output contains (RULER's string match over all answers)."""
    return sum(answer.lower() in output.lower() for answer in answers) / len(answers)

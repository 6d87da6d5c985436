"""kjv_cloze: the data ships beside the YAML (kjv_cloze.jsonl), so the task runs offline, from a checkout or from the
installed wheel (lm/_shipped/eval/tasks/kjv_cloze/). lm-eval would resolve a relative `data_files` against the working
directory, so `custom_dataset` loads the file relative to this one instead.

`python eval/tasks/kjv_cloze/utils.py` rebuilds kjv_cloze.jsonl from the bundled corpus (data_prep/corpus/kjv.jsonl.gz,
at the same relative place in a checkout and in the wheel): every 293rd verse of 12 to 40 words, cut in the middle;
the choices are its own second half and those of the next three picked verses, the true one at position i mod 4."""

import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "kjv_cloze.jsonl"
CORPUS = HERE.parents[2] / "data_prep" / "corpus" / "kjv.jsonl.gz"
ITEMS, EVERY, CHOICES = 40, 293, 4


def load(**kwargs):
    """lm-eval's custom_dataset: called with the task's metadata and dataset_kwargs, which it does not need."""
    import datasets

    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def verses(corpus: Path = CORPUS) -> list[str]:
    """The corpus's verses: each chapter is "Book N", a blank line, then one verse per line."""
    out = []
    with gzip.open(corpus, "rt") as f:
        for line in f:
            out += [v.strip() for v in json.loads(line)["text"].split("\n")[2:] if v.strip()]
    return out


def build(corpus: Path = CORPUS) -> list[dict]:
    picked = [v.split() for v in verses(corpus)[::EVERY] if 12 <= len(v.split()) <= 40][:ITEMS]
    halves = [(" ".join(w[: len(w) // 2]), " " + " ".join(w[len(w) // 2:])) for w in picked]
    rows = []
    for i, (context, ending) in enumerate(halves):
        others = [halves[(i + k) % len(halves)][1] for k in range(1, CHOICES)]
        answer = i % CHOICES
        rows.append({"context": context, "choices": others[:answer] + [ending] + others[answer:], "answer": answer})
    return rows


if __name__ == "__main__":
    DATA.write_text("".join(json.dumps(row) + "\n" for row in build()))
    print(f"wrote {DATA}")

"""`lm demo`: the embedded default. Prepare the bundled corpus, train a tiny model on CPU, evaluate, sample."""

import contextlib
import csv
import io
import sys
import time
from pathlib import Path

from lm.util.errors import UserError
from lm.util.resources import shipped

DEMO_CONFIG = shipped("configs/demo.yaml")
NEXT_STEP = ("next: `lm compare demo`, the comparison: every mixer and Hawk-Mesa at matched parameters, on CPU "
             "in about 15 min")


def last_logged(run_dir: Path, key: str) -> float | None:
    """The last value of `key` in the run's CSV logs (all launches)."""
    value = None
    for path in sorted((run_dir / "logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:])):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get(key):
                    value = float(row[key])
    return value


def demo(mixer: str = "attention", run_dir: str | None = None, max_steps: int | None = None,
         recipe: str = str(DEMO_CONFIG), progress: bool = True, sample_tokens: int = 60) -> dict:
    """Prepare the bundled KJV corpus, train the tiny model of configs/demo.yaml on CPU, evaluate, sample.

    Args:
        mixer: The sequence mixer of every layer (a name in lm.mixers.MIXERS).
        run_dir: Where everything goes (data, checkpoints, logs, evaluation); default runs/demo, or
            runs/demo-MIXER for another mixer. A rerun resumes there.
        max_steps: Override the recipe's optimizer steps.
        recipe: The training config.
        progress: Show progress bars.
        sample_tokens: Tokens generated for the sample at the end.
    """
    from lm.data_prep.prepare import BUNDLED_CORPUS, prepare
    from lm.eval.ppl import evaluate_ppl, unigram_ppl
    from lm.generate import generate_text
    from lm.training.config import parse_run_config
    from lm.training.train import train

    if not Path(recipe).is_file():
        raise UserError(f"demo recipe {recipe} not found")
    if sample_tokens < 0:  # checked now: the sample comes after the training
        raise UserError(f"--sample_tokens must be at least 0, got {sample_tokens}")
    start = time.perf_counter()
    run_dir = run_dir or ("runs/demo" if mixer == "attention" else f"runs/demo-{mixer}")
    data = str(Path(run_dir) / "data")
    overrides = ["--run_dir", run_dir, "--data.path", data, "--trainer.progress_bar", str(progress).lower(),
                 "--model.mixer", mixer]
    overrides += ["--trainer.max_steps", str(max_steps)] if max_steps is not None else []
    config, resume, yaml = parse_run_config(["--config", recipe] + overrides)
    prepare([str(BUNDLED_CORPUS)], data, vocab_size=config.model.vocab_size, progress=progress)
    checkpoint = train(config, resume, yaml)
    eval_dir = Path(run_dir) / "eval" / f"ppl-validation-T{config.data.seq_len}"  # lm eval ppl's own default
    with contextlib.redirect_stdout(io.StringIO()):  # its JSON line: the summary below says the same
        result = evaluate_ppl(str(checkpoint), out=str(eval_dir))
    unigram = unigram_ppl(data)
    sample = generate_text(str(checkpoint), prompt="And God said", max_new_tokens=sample_tokens)
    sample_file = Path(run_dir) / "sample.txt"
    sample_file.write_text(sample + "\n")
    steps = config.trainer.max_steps
    tokens = steps * (config.trainer.accumulate or 1) * config.data.micro_batch * config.data.seq_len
    summary = {"mixer": mixer, "steps": steps, "tokens": tokens, "val_ppl": result["ppl"], "unigram_ppl": unigram,
               "tokens_per_s": last_logged(Path(run_dir), "train/device/items_per_sec"),
               "wall_s": time.perf_counter() - start, "run_dir": run_dir, "data": data,
               "checkpoint": str(checkpoint), "eval": str(eval_dir), "sample": str(sample_file)}
    print_summary(summary, sample)
    return summary


def print_summary(s: dict, sample: str) -> None:
    """The figures, where each file went, the sample and the next step."""
    speed = f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else "n/a"
    rows = [("mixer", s["mixer"]), ("steps", f"{s['steps']:,}"), ("tokens trained", f"{s['tokens']:,}"),
            ("validation ppl", f"{s['val_ppl']:.2f}"), ("unigram ppl (the bar)", f"{s['unigram_ppl']:.2f}"),
            ("training tokens/s", speed), ("wall time", f"{s['wall_s']:.0f} s"),
            ("run directory", f"{s['run_dir']} (config.yaml, tokenizer.json, logs/version_N/metrics.csv)"),
            ("data", f"{s['data']} (tokenizer, token shards, manifest.json)"), ("checkpoint", s["checkpoint"]),
            ("evaluation", f"{s['eval']} (ppl.json, per_position.csv, per_position.png)"), ("sample", s["sample"])]
    width = max(len(k) for k, _ in rows)
    out = sys.stdout
    quoted = "\n".join(f"  {line}" for line in sample.splitlines())  # every line of a sample indented, as one block
    out.write("\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows) + "\n\nsample:\n" + quoted + "\n")
    out.write(f"\n{NEXT_STEP}\n")

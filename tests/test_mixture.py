"""Mixtures of prepared sources (data.sources): the schedule against exact rational arithmetic, each source's share of
a real run measured from the windows it trained on, the logged tokens and per-source validation losses recomputed,
an exact resume, the same global order at another world size, `lm eval ppl` scoring every source and their weighted
mean (each data in its own folder), and bad input refused before anything is written."""

import csv
import json
import math
import random
from fractions import Fraction
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lm.cli import main
from lm.data_prep.prepare import prepare
from lm.training.config import parse_run_config
from lm.training.data import DataConfig, TokenStream, TrainWindows, ValidationWindows
from lm.training.data_module import TokenDataModule
from lm.training.mixture import PERIOD, MixtureSchedule
from lm.training.train import train
from lm.util.errors import UserError

SEQ = 32
SLIMPAJAMA = [0.522, 0.267, 0.052, 0.042, 0.046, 0.038, 0.033]


# The schedule

def exact_rank(schedule: MixtureSchedule, source: int, k: int) -> int:
    """Where source's k-th slot falls in the pattern by definition: the number of keys (j + 1/2) / a_t below its
    key (a tie goes to the lower source), counted in exact rationals."""
    key = Fraction(2 * k + 1, 2 * int(schedule.rates[source]))
    below = 0
    for t, a in enumerate(int(a) for a in schedule.rates):
        x = key * a - Fraction(1, 2)  # source t's slots j < x come first
        below += min(a, max(0, math.ceil(x)))
        if t < source and x.denominator == 1 and 0 <= x < a:
            below += 1
    return below


@pytest.mark.parametrize("weights", [[0.5, 0.5], [3, 1], SLIMPAJAMA, [1.0], [1e-3, 1.0, 0.25]])
def test_schedule_follows_its_definition_and_keeps_every_prefix_within_two_windows(weights):
    schedule = MixtureSchedule(weights)
    assert schedule.rates.sum() == PERIOD
    assert np.abs(schedule.shares - np.asarray(weights) / sum(weights)).max() <= 1 / PERIOD
    rng = random.Random(0)
    for _ in range(40):  # slots checked against the definition in exact arithmetic
        source = rng.randrange(len(weights))
        k = rng.randrange(int(schedule.rates[source]))
        slot = exact_rank(schedule, source, k)
        assert schedule.pattern[slot] == source and schedule.rank[slot] == k
    # Two periods and a bit, position by position: each source's n counts its earlier positions, and its count
    # stays within two windows of its share at every prefix.
    positions = 2 * PERIOD + 777
    seen = np.zeros(len(weights), dtype=np.int64)
    worst = 0.0
    for p in range(positions):
        source, n = schedule.locate(p)
        assert n == seen[source]
        seen[source] += 1
        if p % 97 == 0:
            worst = max(worst, np.abs(seen - (p + 1) * schedule.shares).max())
    assert worst < 2
    assert np.array_equal(schedule.counts(positions), seen)


def test_schedule_refuses_a_weight_it_cannot_draw():
    with pytest.raises(UserError, match="below 1/65536"):
        MixtureSchedule([1e-6, 1.0])


# Two sources sharing the bundled corpus's tokenizer

def numbers_text(i: int) -> str:
    rng = random.Random(i)
    return f"Record {i}. " + " ".join(str(rng.randrange(10**6)) for _ in range(150))


@pytest.fixture(scope="module")
def numbers(kjv_data, tmp_path_factory) -> str:
    """A second source: numbers, tokenized with the bundled corpus's tokenizer."""
    tmp = tmp_path_factory.mktemp("numbers")
    (tmp / "numbers.jsonl").write_text("".join(f'{{"text": "{numbers_text(i)}"}}\n' for i in range(80)))
    out = tmp / "numbers"
    prepare([str(tmp / "numbers.jsonl")], str(out), tokenizer=str(Path(kjv_data) / "tokenizer.json"),
            val_fraction=0.05, progress=False)
    return str(out)


@pytest.fixture(scope="module")
def window_index(kjv_data, numbers) -> dict[bytes, tuple[int, int]]:
    """Every training window of both sources by its bytes -> (source, window), so that what a loader or a run
    read can be traced back to its source independently of the schedule."""
    index = {}
    for source, path in enumerate([kjv_data, numbers]):
        stream = TokenStream(path, "train")
        tokens = stream.read(0, stream.total)
        for w in range((stream.total - 1) // SEQ):
            index.setdefault(tokens[w * SEQ:w * SEQ + SEQ + 1].tobytes(), (source, w))
    return index


def traced(index: dict, batches) -> list[tuple[int, int]]:
    return [index[row.numpy().astype(np.int64).tobytes()] for batch in batches for row in batch]


def loader_order(kjv_data, numbers, weights, world, workers, micro_batch, start, steps) -> list[tuple[int, int]]:
    """Windows in the order the whole world consumes them, each rank through a real DataLoader."""
    module = TokenDataModule(DataConfig(sources=[{"path": kjv_data, "weight": weights[0]},
                                                 {"path": numbers, "weight": weights[1]}],
                                        seq_len=SEQ, micro_batch=micro_batch, seed=5))
    loaders = [iter(DataLoader(TrainWindows(module.train_streams, SEQ, micro_batch, 5, start, rank, world,
                                            module.schedule), batch_size=None, num_workers=workers))
               for rank in range(world)]
    order = []
    for _ in range(steps):
        per_rank = [next(loader) for loader in loaders]
        for u in range(micro_batch):
            order += [per_rank[r][u] for r in range(world)]
    return order


def test_loader_shares_resume_and_world_size_keep_the_global_order(kjv_data, numbers, window_index):
    reference = traced(window_index, [torch.stack(loader_order(kjv_data, numbers, (0.7, 0.3), 1, 0, 8, 0, 100))])
    shares = np.bincount([s for s, _ in reference], minlength=2) / len(reference)
    assert abs(shares[0] - 0.7) < 0.01, shares
    # Another world size, other workers and micro-batches, from the start and from resumes mid-stream.
    assert traced(window_index, [torch.stack(loader_order(kjv_data, numbers, (0.7, 0.3), 2, 2, 3, 0, 20))]) == \
        reference[:120]
    for start in (7, 301):
        resumed = loader_order(kjv_data, numbers, (0.7, 0.3), 2, 1, 5, start, 6)
        assert traced(window_index, [torch.stack(resumed)]) == reference[start:start + 60]
    # Each source's windows are its own seeded permutation: none repeats within an epoch of that source.
    numbers_windows = [w for s, w in reference if s == 1]
    assert len(set(numbers_windows)) == len(numbers_windows) and numbers_windows != sorted(numbers_windows)


def test_a_mixture_of_one_reads_as_data_path(kjv_data):
    one = TokenDataModule(DataConfig(path=kjv_data, seq_len=SEQ, micro_batch=4, num_workers=0, seed=3))
    listed = TokenDataModule(DataConfig(sources=[{"path": kjv_data, "weight": 2.0}], seq_len=SEQ, micro_batch=4,
                                        num_workers=0, seed=3))
    for module in (one, listed):
        module.windows_consumed = 40
    a, b = iter(one.train_dataloader()), iter(listed.train_dataloader())
    for _ in range(5):
        assert torch.equal(next(a), next(b))


# A real run

STEPS, BATCH = 50, 8


def mixture_config(tmp: Path, kjv_data: str, numbers: str, run_dir: Path, extra: str = "") -> Path:
    path = tmp / f"{run_dir.name}.yaml"
    path.write_text(f"""
run_dir: {run_dir}
seed: 2
model: {{vocab_size: 512, d_model: 32, n_layers: 1, n_heads: 2, head_dim: 16, max_seq_len: {SEQ}}}
data:
  sources:
    - {{path: {kjv_data}, weight: 0.75, name: bible}}
    - {{path: {numbers}, weight: 0.25}}
  seq_len: {SEQ}
  micro_batch: {BATCH}
  num_workers: 0
  val_windows: 4
optim: {{lr: 3.0e-3, warmup_steps: 2}}
strategy: {{accelerator: cpu}}
trainer: {{max_steps: {STEPS}, val_every: 25, ckpt_every: 25, log_every: 5, progress_bar: false}}
{extra}""")
    return path


class RecordBatches(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch.clone())


def run(config: Path, *overrides: str) -> RecordBatches:
    recorder = RecordBatches()
    cfg, resume, yaml = parse_run_config(["--config", str(config), *overrides])
    train(cfg, resume, yaml, callbacks=[recorder])
    return recorder


@pytest.fixture(scope="module")
def straight(kjv_data, numbers, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixture")
    recorder = run(mixture_config(tmp, kjv_data, numbers, tmp / "straight"))
    return tmp / "straight", recorder.batches


def metrics(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(run_dir.glob("logs/version_*/metrics.csv")):
        with open(path) as f:
            rows += list(csv.DictReader(f))
    return rows


def test_a_run_draws_each_source_at_its_weight_and_logs_its_tokens(straight, window_index):
    run_dir, batches = straight
    sources = [s for s, _ in traced(window_index, batches)]
    assert len(sources) == STEPS * BATCH
    share = sources.count(0) / len(sources)
    assert abs(share - 0.75) < 0.01, share
    logged = {}
    for row in metrics(run_dir):
        for name in ("bible", "numbers"):
            if row.get(f"data/tokens/{name}"):
                logged[(int(row["step"]), name)] = float(row[f"data/tokens/{name}"])
    last = max(step for step, _ in logged)
    # The step column is the optimizer steps done: the rows of that many steps were trained on.
    trained = sources[:last * BATCH]
    assert logged[(last, "bible")] == trained.count(0) * SEQ
    assert logged[(last, "numbers")] == trained.count(1) * SEQ


def test_validation_reports_each_source_and_their_weighted_mean(straight, kjv_data, numbers):
    from lm.training.checkpoint import load_model

    run_dir, _ = straight
    row = next(r for r in metrics(run_dir) if r.get("val/loss") and int(r["step"]) == STEPS)
    model, _ = load_model(str(run_dir / "checkpoints" / f"step={STEPS:08d}.ckpt"))
    expected = {}
    for name, path in (("bible", kjv_data), ("numbers", numbers)):
        validation = ValidationWindows(TokenStream(path, "validation"), SEQ, 4)
        windows = torch.stack([validation[i] for i in range(len(validation))])
        with torch.no_grad():
            logits, _ = model(windows[:, :-1])
        expected[name] = F.cross_entropy(logits.double().flatten(0, 1), windows[:, 1:].flatten()).item()
        assert float(row[f"val/loss/{name}"]) == pytest.approx(expected[name], rel=1e-5)
    assert float(row["val/loss"]) == pytest.approx(0.75 * expected["bible"] + 0.25 * expected["numbers"], rel=1e-5)


def test_resume_mid_run_trains_the_same_batches_to_the_same_weights(straight, kjv_data, numbers, tmp_path):
    run_dir, batches = straight
    resumed = tmp_path / "resumed"
    recorder = run(mixture_config(tmp_path, kjv_data, numbers, resumed), "--resume",
                   str(run_dir / "checkpoints" / "step=00000025.ckpt"))
    assert len(recorder.batches) == STEPS - 25
    assert all(torch.equal(a, b) for a, b in zip(recorder.batches, batches[25:], strict=True))
    a = torch.load(run_dir / "checkpoints" / f"step={STEPS:08d}.ckpt", weights_only=True)["state_dict"]
    b = torch.load(resumed / "checkpoints" / f"step={STEPS:08d}.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# Bad input: one line, exit 2, nothing written

@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("other")
    (tmp / "numbers.jsonl").write_text("".join(f'{{"text": "{numbers_text(i)}"}}\n' for i in range(20)))
    prepare([str(tmp / "numbers.jsonl")], str(tmp / "data"), vocab_size=300, progress=False)
    return str(tmp / "data")


@pytest.mark.parametrize("case", ["tokenizer", "missing", "unknown-key", "path-and-sources", "weights-and-tokens",
                                  "tokens-not-the-run", "same-name"])
def test_bad_mixtures_are_one_line_and_write_nothing(case, kjv_data, numbers, other_tokenizer, tmp_path, capsys):
    second = {"tokenizer": f"{{path: {other_tokenizer}, weight: 1}}",
              "missing": f"{{path: {tmp_path / 'nowhere'}, weight: 1}}",
              "unknown-key": f"{{path: {numbers}, wieght: 1}}",
              "weights-and-tokens": f"{{path: {numbers}, tokens: 1000}}",
              "same-name": f"{{path: {numbers}, weight: 1, name: bible}}"}.get(case, f"{{path: {numbers}, weight: 1}}")
    first = f"{{path: {kjv_data}, {'tokens: 1000' if case == 'tokens-not-the-run' else 'weight: 1'}, name: bible}}"
    if case == "tokens-not-the-run":
        second = f"{{path: {numbers}, tokens: 3000}}"
    config = tmp_path / "bad.yaml"
    config.write_text(f"""
run_dir: {tmp_path / 'run'}
model: {{vocab_size: 512, d_model: 32, n_layers: 1, n_heads: 2, head_dim: 16, max_seq_len: {SEQ}}}
data: {{sources: [{first}, {second}], seq_len: {SEQ}, micro_batch: 2, num_workers: 0{
        f', path: {kjv_data}' if case == 'path-and-sources' else ''}}}
trainer: {{max_steps: 10, progress_bar: false}}
strategy: {{accelerator: cpu}}
""")
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    expected = {"tokenizer": "another tokenizer", "missing": "nowhere", "unknown-key": "wieght",
                "path-and-sources": "not both", "weights-and-tokens": "not a mix",
                "tokens-not-the-run": "the run trains 640", "same-name": "two sources are named 'bible'"}[case]
    assert expected in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_two_processes_report_the_same_per_source_validation(kjv_data, numbers, tmp_path):
    """DDP on 2 processes, each validating its half of every source's windows: the per-source losses are reduced
    over both, and equal one process's with the same global batch."""
    import subprocess
    import sys

    config = mixture_config(tmp_path, kjv_data, numbers, tmp_path / "one")
    short = ["--trainer.max_steps", "4", "--trainer.val_every", "4", "--data.global_batch", str(BATCH)]
    run(config, *short)
    two = tmp_path / "two"
    result = subprocess.run([sys.executable, "-m", "lm.cli", "train", "--config", str(config), *short, "--run_dir",
                             str(two), "--strategy.name", "ddp", "--strategy.devices", "2", "--data.micro_batch",
                             str(BATCH // 2)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {name: next(r for r in metrics(tmp_path / name) if r.get("val/loss")) for name in ("one", "two")}
    for key in ("val/loss/bible", "val/loss/numbers", "val/loss"):
        assert float(rows["two"][key]) == pytest.approx(float(rows["one"][key]), rel=1e-4), key


# lm eval ppl on a mixture run

def direct_nll(model, path: str, windows: int = 4) -> np.ndarray:
    """[windows, SEQ] NLL of each target of a source's first validation windows, from the model's logits."""
    stream = TokenStream(path, "validation")
    batch = torch.stack([torch.from_numpy(stream.read(i * SEQ, SEQ + 1)) for i in range(windows)])
    with torch.no_grad():
        logits, _ = model(batch[:, :-1])
    nll = F.cross_entropy(logits.double().flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
    return nll.view(windows, SEQ).numpy()


def read_eval(folder: Path) -> tuple[dict, dict[int, float]]:
    """(ppl.json, position -> NLL of per_position.csv)."""
    with open(folder / "per_position.csv") as f:
        rows = {int(r["position"]): float(r["nll"]) for r in csv.DictReader(f)}
    return json.loads((folder / "ppl.json").read_text()), rows


@pytest.fixture(scope="module")
def evaluated(straight) -> list[str]:
    """`lm eval ppl` on the mixture run, as a user runs it; its stdout lines."""
    import contextlib
    import io

    run_dir, _ = straight
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["eval", "ppl", "--checkpoint", str(run_dir), "--max_windows", "4"]) == 0
    return printed.getvalue().splitlines()


def test_eval_ppl_of_a_mixture_run_scores_every_source_and_their_weighted_mean(straight, evaluated, kjv_data,
                                                                                numbers):
    from lm.training.checkpoint import load_model

    run_dir, _ = straight
    model, _ = load_model(str(run_dir / "checkpoints" / f"step={STEPS:08d}.ckpt"))
    direct = {"bible": direct_nll(model, kjv_data), "numbers": direct_nll(model, numbers)}
    weights, paths = {"bible": 0.75, "numbers": 0.25}, {"bible": kjv_data, "numbers": numbers}
    for name, nll in direct.items():
        result, curve = read_eval(run_dir / "eval" / f"ppl-validation-T{SEQ}-{name}")
        assert result["data"] == paths[name] and result["weight"] == weights[name]
        assert result["loss"] == pytest.approx(nll.mean(), rel=1e-5)
        for k, value in curve.items():
            assert value == pytest.approx(nll[:, k - 1].mean(), rel=1e-5, abs=1e-6), (name, k)
    mixture, curve = read_eval(run_dir / "eval" / f"ppl-validation-T{SEQ}")  # the default folder: the mixture
    assert mixture["loss"] == pytest.approx(sum(w * direct[n].mean() for n, w in weights.items()), rel=1e-5)
    assert mixture["ppl"] == pytest.approx(math.exp(mixture["loss"]))
    for k, value in curve.items():
        assert value == pytest.approx(sum(w * direct[n][:, k - 1].mean() for n, w in weights.items()), rel=1e-5)
    # The same numbers as the run's last validation (val_windows 4), which weights the sources as it trains on them.
    row = next(r for r in metrics(run_dir) if r.get("val/loss") and int(r["step"]) == STEPS)
    assert mixture["loss"] == pytest.approx(float(row["val/loss"]), rel=1e-5)
    # stdout: one JSON line, the mixture's, with every source's result.
    assert len(evaluated) == 1 and json.loads(evaluated[0]) == mixture
    for name in weights:
        assert mixture["sources"][name]["loss"] == pytest.approx(float(row[f"val/loss/{name}"]), rel=1e-5)


def test_each_data_writes_its_own_folder(straight, evaluated, numbers, tmp_path, capsys):
    import shutil

    run_dir, _ = straight
    before = {p: p.read_bytes() for p in (run_dir / "eval").glob(f"ppl-validation-T{SEQ}*/ppl.json")}
    # A source of the run: the folder the mixture's evaluation wrote for it, with the same result.
    assert main(["eval", "ppl", "--checkpoint", str(run_dir), "--max_windows", "4", "--data", numbers]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["data"] == numbers and "weight" not in alone
    assert alone["loss"] == json.loads(before[run_dir / "eval" / f"ppl-validation-T{SEQ}-numbers" / "ppl.json"])["loss"]
    # Other data: a folder named after its directory, beside the others.
    other = tmp_path / "more numbers"
    shutil.copytree(numbers, other)
    assert main(["eval", "ppl", "--checkpoint", str(run_dir), "--max_windows", "2", "--data", str(other)]) == 0
    result = json.loads((run_dir / "eval" / f"ppl-validation-T{SEQ}-more_numbers" / "ppl.json").read_text())
    assert result["data"] == str(other) and result["windows"] == 2
    for path, text in before.items():  # the mixture's and the bible's results are untouched
        if "-numbers" not in path.parent.name:
            assert path.read_bytes() == text, path


def test_eval_targets_keep_the_default_folder_for_the_runs_own_data(tmp_path):
    from lm.eval.ppl import Target, eval_targets

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert eval_targets({"path": a}, None) == [Target(a)]
    assert eval_targets({"path": a}, a) == [Target(a)]
    assert eval_targets({"path": a}, str(tmp_path / "x" / "b")) == [Target(str(tmp_path / "x" / "b"), "b")]
    assert eval_targets({"sources": [{"path": a, "weight": 1.0}]}, None) == [Target(a)]  # a mixture of one
    assert eval_targets({"sources": [{"path": a, "tokens": 300, "name": "A"}, {"path": b, "tokens": 100}]}, None) == \
        [Target(a, "A", 0.75), Target(b, "b", 0.25)]
    assert eval_targets({"sources": [{"path": a, "weight": 3, "name": "A"}, {"path": b, "weight": 1}]}, a) == \
        [Target(a, "A")]


@pytest.mark.parametrize("case", ["missing-source", "other-tokenizer-source", "missing-data", "data-named-alike"])
def test_bad_eval_of_a_mixture_is_one_line_and_writes_nothing(case, straight, kjv_data, numbers, other_tokenizer,
                                                               tmp_path, capsys):
    """On a copy of the run whose config names another second source (missing, or of another tokenizer), or with
    --data that is missing or named like the run's source whose folder holds its results."""
    import shutil

    from lm.data_prep.shards import sha256_file

    run_dir, _ = straight
    copy = tmp_path / "run"
    (copy / "checkpoints").mkdir(parents=True)
    for path in (run_dir / "checkpoints").glob(f"step={STEPS:08d}.ckpt*"):
        shutil.copy(path, copy / "checkpoints")
    shutil.copy(run_dir / "tokenizer.json", copy)
    second = {"missing-source": str(tmp_path / "nowhere"), "other-tokenizer-source": other_tokenizer}.get(case, numbers)
    (copy / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace(numbers, second))
    args = ["eval", "ppl", "--checkpoint", str(copy), "--max_windows", "2"]
    if case == "missing-data":
        args += ["--data", str(tmp_path / "nowhere")]
    if case == "data-named-alike":
        shutil.copytree(numbers, tmp_path / "elsewhere" / "numbers")
        args += ["--data", str(tmp_path / "elsewhere" / "numbers")]
        (copy / "eval" / f"ppl-validation-T{SEQ}-numbers").mkdir(parents=True)
        (copy / "eval" / f"ppl-validation-T{SEQ}-numbers" / "ppl.json").write_text(json.dumps({"data": numbers}))
    before = {p: sha256_file(p) for p in sorted(copy.rglob("*")) if p.is_file()}
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    expected = {"missing-source": f"missing {tmp_path / 'nowhere' / 'manifest.json'}",
                "other-tokenizer-source": f"{other_tokenizer} was tokenized with another tokenizer",
                "missing-data": f"missing {tmp_path / 'nowhere' / 'manifest.json'}",
                "data-named-alike": f"holds the evaluation of {numbers}, another directory named numbers"}[case]
    assert expected in err and "\n" not in err and "Traceback" not in err, err
    assert {p: sha256_file(p) for p in sorted(copy.rglob("*")) if p.is_file()} == before

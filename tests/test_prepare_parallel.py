"""lm prepare beyond one process: --workers N, a SLURM array's plan, parts and merge (run here, in-process), a BPE
trained on a sample, and a recipe that routes each record to the dataset of its source. Every way must write the bytes
one plain process writes: the same shards, sha256s, tokenizer.json and manifest.json."""

import gzip
import json
from pathlib import Path

import pytest
import yaml
import zstandard

from lm.cli import main
from lm.data_prep import BUNDLED_CORPUS, load_manifest, prepare
from lm.data_prep import sources as sources_module
from lm.data_prep.recipe import load_recipe
from lm.data_prep.sample import Sample, sample_documents
from lm.data_prep.shards import WHOLE, sha256_file
from lm.data_prep.sources import make_source
from lm.data_prep.tokenizer import tokenizer_key

# Small shards, so that documents straddle them; small batches, so that every worker gets several.
SETTINGS = {"vocab_size": 512, "shard_tokens": 150_000, "batch_docs": 40, "progress": False}
SETS = ["RedPajamaC4", "RedPajamaGithub", "RedPajamaWikipedia", "RedPajamaBook"]  # the last one is in no recipe


def chapters() -> list[str]:
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        return [json.loads(line)["text"] for line in f]


def write(path: Path, records: list[dict]) -> None:
    """.jsonl, .jsonl.gz or .jsonl.zst by the name."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def digests(out: Path) -> dict[str, str]:
    """sha256 of every file of a prepared directory (shards, tokenizer.json, manifest.json)."""
    return {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}


def tree(root: Path) -> dict:
    """Every path under root with its size and mtime: to prove nothing was written."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The bundled corpus as four files of unequal sizes, plain, gzip and zstd."""
    root = tmp_path_factory.mktemp("corpus")
    texts = chapters()
    cuts = [0, 300, 700, 1000, len(texts)]
    for i, name in enumerate(["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.jsonl"]):
        write(root / name, [{"text": t} for t in texts[cuts[i]:cuts[i + 1]]])
    return root


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """One process, the tokenizer's own threads: what every other way must write."""
    out = tmp_path_factory.mktemp("reference") / "out"
    prepare([str(corpus)], str(out), **SETTINGS)
    return out


def test_the_reference_has_documents_that_straddle_shards(reference):
    manifest = load_manifest(reference)
    assert len(manifest["splits"]["train"]["shards"]) >= 10
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["validation"]["documents"] == 1189


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_write_the_same_bytes(corpus, reference, tmp_path, workers):
    out = tmp_path / "out"
    prepare([str(corpus)], str(out), workers=workers, **SETTINGS)
    assert digests(out) == digests(reference)


def test_workers_are_not_in_the_fingerprint(corpus, reference, capsys):
    before = tree(reference)
    prepare([str(corpus)], str(reference), workers=4, **SETTINGS)
    assert tree(reference) == before
    assert f"reusing {reference}" in capsys.readouterr().err


def test_a_plan_its_parts_and_a_merge_write_the_same_bytes(corpus, reference, tmp_path):
    out = tmp_path / "out"
    step = lambda **kw: prepare([str(corpus)], str(out), tasks=2, **SETTINGS, **kw)  # noqa: E731
    plan = step()
    assert plan["shares"] == [[0, 1], [1, 4]]  # contiguous, balanced by bytes: the first file holds half of them
    step(task=1)  # the tasks may end in any order
    step(task=0)
    step(merge=True)
    assert digests(out) == digests(reference)
    assert [p.name for p in (out / ".parts").iterdir()] == ["plan.json"]  # the parts are removed
    before = tree(out)
    step(merge=True)  # a second merge finds the dataset done
    assert tree(out) == before


# ---------------------------------------------------------------- the tokenizer's sample


def test_the_sample_reads_only_its_budget_from_files_in_a_seeded_order(corpus, monkeypatch):
    source = make_source([str(corpus)])
    opened = []
    read_file = sources_module.read_file
    monkeypatch.setattr(sources_module, "read_file", lambda path, *a: opened.append(path.name) or read_file(path, *a))

    docs = list(sample_documents(source, Sample(docs=20, seed=0)))
    assert len(docs) == 20 and len(opened) == 1  # no other file is even opened
    whole = sum(1 for _ in make_source([str(corpus / opened[0])]).documents())
    opened.clear()
    assert len(list(sample_documents(source, Sample(docs=whole, seed=0)))) == whole
    assert len(opened) == 1  # the budget ends with the first file: the next one is not opened
    assert list(sample_documents(source, Sample(docs=20, seed=0))) == docs  # deterministic
    firsts = set()
    for seed in range(8):
        opened.clear()
        list(sample_documents(source, Sample(docs=1, seed=seed)))
        firsts.add(opened[0])
    assert len(firsts) > 1  # the seed picks where the sample starts

    docs = list(sample_documents(source, Sample(bytes=100_000, seed=0)))
    sizes = [len(text.encode()) for text, _ in docs]
    assert sum(sizes) >= 100_000 > sum(sizes[:-1])


def test_a_sample_trained_tokenizer_is_deterministic_and_in_the_fingerprint(corpus, reference, tmp_path):
    assert tokenizer_key(None, 512) == "bpe:512"  # no sample: the key, so the fingerprint, of older calls
    a = prepare([str(corpus)], str(tmp_path / "a"), tokenizer_sample_docs=100, **SETTINGS)
    prepare([str(corpus)], str(tmp_path / "b"), tokenizer_sample_docs=100, **SETTINGS)
    assert digests(tmp_path / "a") == digests(tmp_path / "b")
    assert a["fingerprint"] != load_manifest(reference)["fingerprint"]
    assert sha256_file(tmp_path / "a" / "tokenizer.json") != sha256_file(reference / "tokenizer.json")
    c = prepare([str(corpus)], str(tmp_path / "c"), tokenizer_sample_docs=100, seed=1, **SETTINGS)
    assert c["fingerprint"] != a["fingerprint"]


# ---------------------------------------------------------------- a recipe


@pytest.fixture(scope="module")
def slimpajama(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """A SlimPajama-shaped corpus (chunk*/*.jsonl.zst, meta.redpajama_set_name) and a recipe of three of its sets."""
    root = tmp_path_factory.mktemp("slimpajama")
    texts = chapters()[:360]
    records = [{"text": t, "meta": {"redpajama_set_name": SETS[i % 7 % 4]}} for i, t in enumerate(texts)]
    names = ["chunk1/example_0.jsonl.zst", "chunk1/example_1.jsonl.zst", "chunk2/example_0.jsonl.zst"]
    for i, name in enumerate(names):
        write(root / "train" / name, records[i * 120:(i + 1) * 120])
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"field": "meta.redpajama_set_name", "sources": [
        {"name": "c4", "value": "RedPajamaC4", "weight": 0.6},
        {"name": "github", "value": "RedPajamaGithub", "weight": 0.3},
        {"name": "wikipedia", "value": "RedPajamaWikipedia", "weight": 0.1}]}))
    return root / "train", recipe, records


@pytest.fixture(scope="module")
def recipe_out(slimpajama, tmp_path_factory) -> Path:
    inputs, recipe, _ = slimpajama
    out = tmp_path_factory.mktemp("recipe") / "out"
    prepare([str(inputs / "chunk*/*.jsonl.zst")], str(out), recipe=str(recipe), workers=2, **SETTINGS)
    return out


def test_a_recipe_writes_a_dataset_per_source_and_the_mixture(slimpajama, recipe_out, capsys):
    _, _, records = slimpajama
    mixture = yaml.safe_load((recipe_out / "mixture.yaml").read_text())
    assert mixture == {"data": {"sources": [
        {"name": "c4", "path": str((recipe_out / "c4").resolve()), "weight": 0.6},
        {"name": "github", "path": str((recipe_out / "github").resolve()), "weight": 0.3},
        {"name": "wikipedia", "path": str((recipe_out / "wikipedia").resolve()), "weight": 0.1}]}}
    tokenizers = set()
    for name, value in (("c4", "RedPajamaC4"), ("github", "RedPajamaGithub"), ("wikipedia", "RedPajamaWikipedia")):
        manifest = load_manifest(recipe_out / name)
        assert manifest["select"] == {"field": "meta.redpajama_set_name", "value": value}
        train, validation = manifest["splits"]["train"], manifest["splits"]["validation"]
        whole = validation["held_out"] == WHOLE  # else validation is the tail of the last training document
        documents = train["documents"] + (validation["documents"] if whole else 0)
        assert documents == sum(r["meta"]["redpajama_set_name"] == value for r in records)
        tokenizers.add(manifest["tokenizer"]["sha256"])
    assert len(tokenizers) == 1  # one tokenizer for the mixture


def test_each_source_of_a_recipe_is_the_dataset_of_its_records_alone(slimpajama, recipe_out, tmp_path):
    """Routing keeps each source's documents in order, and each source's validation draw is its own."""
    _, _, records = slimpajama
    alone = tmp_path / "github.jsonl"
    write(alone, [r for r in records if r["meta"]["redpajama_set_name"] == "RedPajamaGithub"])
    prepare([str(alone)], str(tmp_path / "out"), tokenizer=str(recipe_out / "github" / "tokenizer.json"), **SETTINGS)
    shards = lambda d: {k: v for k, v in digests(d).items() if k.endswith(".bin")}  # noqa: E731
    assert shards(tmp_path / "out") == shards(recipe_out / "github")


def test_a_recipe_as_plan_parts_and_merge_writes_the_same_bytes(slimpajama, recipe_out, tmp_path):
    inputs, recipe, _ = slimpajama
    out = tmp_path / "out"
    step = lambda **kw: prepare([str(inputs)], str(out), recipe=str(recipe), tasks=2, **SETTINGS, **kw)  # noqa: E731
    step()
    step(task=0)
    step(task=1)
    step(merge=True)
    for name in ("c4", "github", "wikipedia"):
        assert digests(out / name) == digests(recipe_out / name)
    assert (out / "mixture.yaml").read_text() == (recipe_out / "mixture.yaml").read_text().replace(
        str(recipe_out.resolve()), str(out.resolve()))


def test_the_shipped_slimpajama_recipe():
    recipe = load_recipe("configs/data/slimpajama.yaml")
    assert recipe.field == "meta.redpajama_set_name" and recipe.tokenizer == "gpt2"
    assert [s.value for s in recipe.sources] == ["RedPajamaCommonCrawl", "RedPajamaC4", "RedPajamaGithub",
                                                 "RedPajamaBook", "RedPajamaArXiv", "RedPajamaWikipedia",
                                                 "RedPajamaStackExchange"]
    assert [s.weight for s in recipe.sources] == [0.522, 0.267, 0.052, 0.042, 0.046, 0.038, 0.033]
    assert abs(sum(s.weight for s in recipe.sources) - 1) < 1e-9
    assert recipe.inputs == ("SlimPajama-627B/train/chunk*/*.jsonl.zst",)


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written


@pytest.fixture
def small(tmp_path) -> Path:
    """Three tiny files, and a plan of 2 tasks with task 0's part written, in tmp_path/out."""
    for i in range(3):
        write(tmp_path / "in" / f"{i}.jsonl", [{"text": f"document {i} {j}: the quick brown fox"} for j in range(20)])
    args = ["--inputs", f"[{tmp_path / 'in'}]", "--out", str(tmp_path / "out"), "--vocab_size", "300",
            "--progress", "false"]
    assert main(["prepare", *args, "--tasks", "2"]) == 0
    assert main(["prepare", *args, "--tasks", "2", "--task", "0"]) == 0
    return tmp_path


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "2", "--merge", "true"], "missing parts for tasks 1 of 2"),
    (["--tasks", "2", "--task", "2"], "--task 2 is out of range: a plan of 2 tasks has tasks 0 to 1"),
    (["--tasks", "2", "--task", "1", "--seed", "1"], "is a plan for other inputs or settings"),
    (["--tasks", "3", "--merge", "true"], "is a plan for other inputs or settings"),
    (["--task", "1"], "give --tasks N too"),
    (["--tasks", "2", "--task", "1", "--merge", "true"], "not both"),
    (["--workers", "0"], "workers must be at least 1"),
    (["--tokenizer_sample_docs", "0"], "tokenizer_sample_docs must be positive"),
    (["--recipe", "nowhere.yaml"], "recipe file nowhere.yaml not found"),
])
def test_bad_input_is_one_line_and_writes_nothing(small, capsys, extra, message):
    args = ["--inputs", f"[{small / 'in'}]", "--out", str(small / "out"), "--vocab_size", "300", "--progress", "false"]
    capsys.readouterr()
    before = tree(small)
    assert main(["prepare", *args, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert tree(small) == before


def test_parts_of_another_plan_are_refused(small, capsys):
    args = ["--inputs", f"[{small / 'in'}]", "--out", str(small / "out"), "--vocab_size", "300", "--progress", "false",
            "--tasks", "2"]
    assert main(["prepare", *args, "--task", "1"]) == 0
    meta = small / "out" / ".parts" / "00001" / "part.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "plan": "0" * 64}))
    capsys.readouterr()
    before = tree(small)
    assert main(["prepare", *args, "--merge", "true"]) == 2
    err = capsys.readouterr().err
    assert "parts for tasks 1 in" in err and "from another plan" in err
    assert tree(small) == before


def test_lm_train_reads_the_mixture_a_recipe_writes(recipe_out, tmp_path):
    from lm.training.config import parse_run_config
    from lm.training.data import TokenDataModule

    base = tmp_path / "base.yaml"
    base.write_text("data: {seq_len: 16, micro_batch: 2, num_workers: 0, val_windows: 1}\n")
    config, _, _ = parse_run_config(["--config", str(base), "--config", str(recipe_out / "mixture.yaml")])
    assert config.data.seq_len == 16  # the mixture adds its sources to the run's data section
    module = TokenDataModule(config.data)
    assert module.names == ["c4", "github", "wikipedia"]
    assert module.schedule.shares.tolist() == pytest.approx([0.6, 0.3, 0.1], abs=1 / 65536)

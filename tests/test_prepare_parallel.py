"""lm prepare beyond one process: --workers N, a SLURM array's plan, parts and merge (run here, in-process), a BPE
trained on a sample, and a recipe that routes each record to the dataset of its source, by a field or by the source's
own files, with one tokenizer. Every way must write the bytes one plain process writes: the same shards, sha256s,
tokenizer.json and manifest.json."""

import gzip
import json
import random
from pathlib import Path

import pytest
import yaml
import zstandard

from lm.cli import main
from lm.data_prep import BUNDLED_CORPUS, load_manifest, prepare
from lm.data_prep import sources as sources_module
from lm.data_prep.recipe import load_recipe
from lm.data_prep.sample import Sample, sample_documents, sample_groups
from lm.data_prep.shards import sha256_file
from lm.data_prep.sources import grouped_source, make_source
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
    validation = manifest["splits"]["validation"]
    assert manifest["splits"]["train"]["documents"] + validation["documents"] == 1189 + validation["cut"]


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
        documents = train["documents"] + validation["documents"] - validation["cut"]  # a cut one counts twice
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
    from lm.training.data_module import TokenDataModule

    base = tmp_path / "base.yaml"
    base.write_text("data: {seq_len: 16, micro_batch: 2, num_workers: 0, val_windows: 1}\n")
    config, _, _ = parse_run_config(["--config", str(base), "--config", str(recipe_out / "mixture.yaml")])
    assert config.data.seq_len == 16  # the mixture adds its sources to the run's data section
    module = TokenDataModule(config.data)
    assert module.names == ["c4", "github", "wikipedia"]
    assert module.schedule.shares.tolist() == pytest.approx([0.6, 0.3, 0.1], abs=1 / 65536)


# ---------------------------------------------------------------- a recipe of files: one tokenizer over several sources


def numbers_text(i: int) -> str:
    rng = random.Random(i)
    return f"Record {i}. " + " ".join(str(rng.randrange(10**6)) for _ in range(150))


@pytest.fixture(scope="module")
def by_files(tmp_path_factory) -> tuple[Path, Path, dict[str, list[str]]]:
    """Two sources with files of their own, Bible chapters (two .jsonl files) and numbers (a .txt file a document),
    and a recipe of them without a field; each source's documents in order."""
    root = tmp_path_factory.mktemp("by_files")
    texts = {"bible": chapters()[:160], "numbers": [numbers_text(i) for i in range(30)]}
    write(root / "bible" / "a.jsonl", [{"text": t} for t in texts["bible"][:100]])
    write(root / "bible" / "b.jsonl.gz", [{"text": t} for t in texts["bible"][100:]])
    for i, text in enumerate(texts["numbers"]):
        (root / "numbers" / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
        (root / "numbers" / f"{i:02d}.txt").write_text(text)
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"sources": [{"name": "bible", "inputs": [str(root / "bible")], "weight": 0.7},
                                                  {"name": "numbers", "inputs": [str(root / "numbers" / "*.txt")],
                                                   "weight": 0.3}]}))
    return root, recipe, texts


@pytest.fixture(scope="module")
def by_files_out(by_files, tmp_path_factory) -> Path:
    _, recipe, _ = by_files
    out = tmp_path_factory.mktemp("by_files_out") / "out"
    prepare(out=str(out), recipe=str(recipe), **SETTINGS)
    return out


def test_a_recipe_of_files_trains_one_bpe_over_every_source_and_prepares_each_alone(by_files, by_files_out, tmp_path):
    from lm.data_prep.tokenizer import save_tokenizer, train_bpe

    root, _, texts = by_files
    files = {"bible": [root / "bible" / "a.jsonl", root / "bible" / "b.jsonl.gz"],
             "numbers": sorted((root / "numbers").glob("*.txt"))}
    assert yaml.safe_load((by_files_out / "mixture.yaml").read_text()) == {"data": {"sources": [
        {"name": "bible", "path": str((by_files_out / "bible").resolve()), "weight": 0.7},
        {"name": "numbers", "path": str((by_files_out / "numbers").resolve()), "weight": 0.3}]}}
    # One tokenizer: the BPE of both sources' documents.
    bpe = save_tokenizer(train_bpe(texts["bible"] + texts["numbers"], SETTINGS["vocab_size"], False),
                         tmp_path / "tokenizer.json")
    for name in ("bible", "numbers"):
        manifest = load_manifest(by_files_out / name)
        assert manifest["tokenizer"]["sha256"] == sha256_file(by_files_out / name / "tokenizer.json") == bpe
        assert manifest["sources"] == [str(p.resolve()) for p in files[name]]
        assert manifest["select"] == {"source": name, "files": manifest["sources"]}
        # Each source's dataset is what its own files give with that tokenizer.
        prepare([str(p) for p in files[name]], str(tmp_path / name), tokenizer=str(tmp_path / "tokenizer.json"),
                **SETTINGS)
        assert {k: v for k, v in digests(tmp_path / name).items() if k.endswith(".bin")} == \
            {k: v for k, v in digests(by_files_out / name).items() if k.endswith(".bin")}


def test_the_bpe_sample_of_a_recipe_of_files_is_shared_out_by_weight(by_files, tmp_path):
    root, recipe, texts = by_files
    source = grouped_source({"bible": [str(root / "bible")], "numbers": [str(root / "numbers")]})
    for weights, counts in (({"bible": 0.7, "numbers": 0.3}, (7, 3)), ({"bible": 1, "numbers": 4}, (2, 8))):
        sample = [text for text, _ in sample_groups(source, Sample(docs=10, seed=3), weights)]
        assert (sum(t in texts["bible"] for t in sample), sum(t in texts["numbers"] for t in sample)) == counts
    sizes = [len(text.encode()) for text, _ in sample_groups(source, Sample(bytes=40_000), {"bible": 3, "numbers": 1})]
    assert len(sizes) > 4 and sum(sizes) < 40_000 + 2 * max(sizes)
    # The weights are in the fingerprint of a sampled tokenizer.
    a = prepare(out=str(tmp_path / "a"), recipe=str(recipe), tokenizer_sample_docs=10, **SETTINGS)
    other = tmp_path / "other.yaml"
    other.write_text(recipe.read_text().replace("0.7", "0.2"))
    b = prepare(out=str(tmp_path / "b"), recipe=str(other), tokenizer_sample_docs=10, **SETTINGS)
    assert load_manifest(tmp_path / "a" / "numbers")["fingerprint"] != load_manifest(tmp_path / "b" / "numbers")[
        "fingerprint"]
    assert a["data"]["sources"][0]["weight"] == 0.7 and b["data"]["sources"][0]["weight"] == 0.2


def test_a_recipe_of_files_as_plan_parts_and_merge_writes_the_same_bytes(by_files, by_files_out, tmp_path):
    _, recipe, _ = by_files
    out = tmp_path / "out"
    for step in ({}, {"task": 1}, {"task": 0}, {"merge": True}):
        prepare(out=str(out), recipe=str(recipe), tasks=2, **SETTINGS, **step)
    for name in ("bible", "numbers"):
        assert digests(out / name) == digests(by_files_out / name)


def test_a_mixture_of_a_recipe_of_files_trains(by_files_out, tmp_path):
    import csv

    from lm.training.config import parse_run_config
    from lm.training.train import train

    base = tmp_path / "base.yaml"
    base.write_text(f"""
run_dir: {tmp_path / 'run'}
model: {{vocab_size: 512, d_model: 32, n_layers: 1, n_heads: 2, head_dim: 16, max_seq_len: 16}}
data: {{seq_len: 16, micro_batch: 2, num_workers: 0, val_windows: 2}}
strategy: {{accelerator: cpu}}
trainer: {{max_steps: 2, val_every: 2, log_every: 1, progress_bar: false}}
""")
    config, resume, frozen = parse_run_config(["--config", str(base), "--config", str(by_files_out / "mixture.yaml")])
    assert train(config, resume, frozen).is_file()
    rows = [r for path in (tmp_path / "run" / "logs").glob("version_*/metrics.csv") for r in csv.DictReader(open(path))]
    row = next(r for r in rows if r.get("val/loss"))
    assert all(float(row[key]) > 0 for key in ("val/loss/bible", "val/loss/numbers", "val/loss"))


@pytest.mark.parametrize("case, message", [
    ("value-without-field", "each source is {name, inputs, weight} (a recipe without `field`"),
    ("no-inputs", "source numbers: inputs must be a non-empty list of paths or globs"),
    ("missing-input", "input not found:"),
    ("file-in-two-sources", "is an input of two sources, bible and numbers"),
    ("top-level-inputs", "`inputs` belongs to a recipe with a `field`"),
    ("command-line-inputs", "gives each source its own inputs: give no --inputs"),
    ("blank-source", "source numbers of recipe"),
])
def test_a_bad_recipe_of_files_is_one_line_and_writes_nothing(by_files, tmp_path, capsys, case, message):
    root, recipe, _ = by_files
    raw = yaml.safe_load(recipe.read_text())
    numbers = raw["sources"][1]
    if case == "value-without-field":
        numbers["value"] = numbers.pop("inputs")[0]
    elif case == "no-inputs":
        numbers["inputs"] = []
    elif case == "missing-input":
        numbers["inputs"] = [str(tmp_path / "nowhere")]
    elif case == "file-in-two-sources":
        numbers["inputs"].append(str(root / "bible" / "b.jsonl.gz"))
    elif case == "top-level-inputs":
        raw["inputs"] = [str(root / "bible")]
    elif case == "blank-source":
        (tmp_path / "blank.txt").write_text(" \n\n")
        numbers["inputs"] = [str(tmp_path / "blank.txt")]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    args = ["prepare", "--recipe", str(bad), "--out", str(tmp_path / "out"), "--progress", "false"]
    args += ["--inputs", f"[{root / 'bible'}]"] if case == "command-line-inputs" else []
    before = tree(tmp_path)
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert tree(tmp_path) == before

"""Tests of data_prep: sources, tokenizer, shards, manifest verification and reuse. Offline, small, fast."""

import gzip
import importlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models

from lm.data_prep import BUNDLED_CORPUS, load_manifest, open_split, prepare
from lm.data_prep.holdout import BY_TOKENS, Holdout, draw, write_splits
from lm.data_prep.shards import DTYPES, sha256_file, token_dtype
from lm.data_prep.sources import decode, iter_documents
from lm.data_prep.tokenizer import separator
from lm.util.errors import UserError

VOCAB = 300  # tiny: 256 bytes + separator + a few merges keeps training instant


# ---------------------------------------------------------------- helpers


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    """A .jsonl (or .jsonl.gz) file with one {field: text} per line."""
    lines = "".join(json.dumps({field: t}) + "\n" for t in texts).encode()
    path.write_bytes(gzip.compress(lines) if path.name.endswith(".gz") else lines)
    return path


def sample_texts(n: int = 12) -> list[str]:
    """Distinct little documents with enough repetition for BPE merges."""
    return [f"Document {i}: the quick brown fox jumps over the lazy dog {i} times.\nAnd again." for i in range(n)]


def split_tokens(out: Path, manifest: dict, split: str) -> np.ndarray:
    """A split's whole token stream (shards concatenated)."""
    maps = open_split(out, manifest, split)
    return np.concatenate(maps) if maps else np.empty(0, DTYPES[manifest["dtype"]])


def split_documents(out: Path, manifest: dict, split: str) -> list[str]:
    """Decode each document of a split (the tokens after each separator)."""
    tokens, sep = split_tokens(out, manifest, split), manifest["tokenizer"]["sep_id"]
    tok = Tokenizer.from_file(str(out / manifest["tokenizer"]["file"]))
    if not len(tokens):
        return []
    starts = np.flatnonzero(tokens == sep)
    assert starts[0] == 0, "a split must start with the separator"
    ends = [*starts[1:], len(tokens)]
    return [tok.decode(tokens[s + 1:e].tolist(), skip_special_tokens=False) for s, e in zip(starts, ends, strict=True)]


def write_book(path: Path, chapters: int = 5) -> str:
    """One .txt file of a few thousand words (the first chapters of the bundled corpus): a one-document corpus."""
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        text = "\n\n".join(json.loads(next(f))["text"] for _ in range(chapters))
    path.write_text(text)
    return text


def snapshot(directory: Path) -> dict:
    """Every file's mtime_ns and bytes, to prove nothing was rewritten."""
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(directory.iterdir())}


def run(inputs, out, **kwargs) -> dict:
    """prepare() with the tiny test vocab and no progress bars."""
    kwargs.setdefault("vocab_size", VOCAB)
    return prepare([str(i) for i in inputs], str(out), progress=False, **kwargs)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No hub access and a private datasets cache, so nothing is downloaded or retried."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(scope="module")
def kjv(tmp_path_factory):
    """The bundled corpus, prepared once for the module."""
    out = tmp_path_factory.mktemp("kjv")
    return out, prepare(out=str(out), vocab_size=VOCAB, progress=False)


# ---------------------------------------------------------------- the bundled corpus


def test_bundled_corpus(kjv):
    out, manifest = kjv
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "lm-shards/1"
    assert manifest["dtype"] == "uint16"
    assert manifest["sources"] == [str(BUNDLED_CORPUS.resolve())]
    assert manifest["replaced_bytes"] == 0
    tok = manifest["tokenizer"]
    assert tok == {**tok, "file": "tokenizer.json", "vocab_size": VOCAB, "sep_id": 0, "sep_token": "<|endoftext|>"}
    assert tok["sha256"] == sha256_file(out / "tokenizer.json")
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == VOCAB

    for split, entry in manifest["splits"].items():
        tokens = split_tokens(out, manifest, split)
        assert entry["tokens"] == len(tokens) == sum(s["tokens"] for s in entry["shards"])
        assert entry["documents"] == int((tokens == 0).sum()) == sum(s["documents"] for s in entry["shards"])
        for shard in entry["shards"]:
            path = out / shard["name"]
            assert shard["sha256"] == sha256_file(path)
            assert path.stat().st_size == shard["tokens"] * 2
    validation, cut = manifest["splits"]["validation"], manifest["splits"]["validation"]["cut"]
    assert validation["held_out"] == BY_TOKENS and validation["documents"] >= 1
    assert sum(e["documents"] for e in manifest["splits"].values()) == 1189 + cut

    # lossless and disjoint: train + validation is exactly the corpus, each chapter once (one perhaps cut in two)
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        chapters = [json.loads(line)["text"] for line in f]
    train, val = split_documents(out, manifest, "train"), split_documents(out, manifest, "validation")
    if cut:
        (tail,) = [v for v in val if v not in chapters]
        val.remove(tail)
        train[-1] += tail  # the cut document's head ends training
    assert Counter(train + val) == Counter(chapters)
    assert not set(train) & set(val)
    # many documents: 1% of the tokens (more than the floor of 64 windows of 256), within a chapter of it
    tokens = validation["tokens"] + manifest["splits"]["train"]["tokens"]
    assert int(0.01 * tokens) <= validation["tokens"] < int(0.01 * tokens) + max(map(len, chapters))
    assert validation["windows"] == (validation["tokens"] - 1) // 256 > 64


def test_reader_memmaps_are_read_only(kjv):
    out, manifest = kjv
    maps = open_split(out, load_manifest(out), "train")
    assert maps and all(isinstance(m, np.memmap) and not m.flags.writeable for m in maps)
    with pytest.raises(UserError, match="unknown split"):
        open_split(out, manifest, "test")


# ---------------------------------------------------------------- sources


def test_round_trip_tricky_text(tmp_path):
    texts = ["  leading spaces and trailing  ", "unicode: naïve café — 日本語 🙂", "crlf\r\nlines\ttabs",
             "a literal <|endoftext|> inside is text, not a separator", *sample_texts(6)]
    manifest = run([write_jsonl(tmp_path / "a.jsonl", texts)], tmp_path / "out")
    docs = split_documents(tmp_path / "out", manifest, "train") + split_documents(tmp_path / "out", manifest,
                                                                                  "validation")
    assert Counter(docs) == Counter(texts)


def test_all_formats_and_directories(tmp_path, offline):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("plain text file\nwith two lines")
    (src / "b.txt.gz").write_bytes(gzip.compress(b"gzipped text file"))
    write_jsonl(src / "c.jsonl", ["json one", "   ", "json two"])
    write_jsonl(src / "sub" / "d.jsonl.gz", ["gz json"])
    pq.write_table(pa.table({"text": ["parquet one", None, "parquet two"], "id": [1, 2, 3]}), src / "sub" / "e.parquet")
    (src / "README.md").write_text("not an input: directories skip unsupported files")
    (src / ".git").mkdir()
    (src / ".git" / "x.txt").write_text("hidden folders are skipped too")
    expected = ["plain text file\nwith two lines", "gzipped text file", "json one", "json two", "gz json",
                "parquet one", "parquet two"]

    assert [t for t, _ in iter_documents([src])] == expected
    assert [t for t, _ in iter_documents(src / "sub" / "e.parquet")] == ["parquet one", "parquet two"]
    assert [t for t, _ in iter_documents([str(src / "*.jsonl")])] == ["json one", "json two"]
    manifest = run([src], tmp_path / "out")
    assert sum(e["documents"] for e in manifest["splits"].values()) == len(expected)

    # the `datasets` path, offline through the local "json" builder
    data = write_jsonl(tmp_path / "ds.jsonl", sample_texts(5))
    for streaming in (False, True):
        docs = iter_documents(dataset="json", data_files=[str(data)], streaming=streaming)
        assert [t for t, _ in docs] == sample_texts(5)
    manifest = run([], tmp_path / "ds_out", dataset="json", data_files=[str(data)])
    assert manifest["sources"] == [f"dataset=json split=train data_files={data}"]
    assert sum(e["documents"] for e in manifest["splits"].values()) == 5


def test_text_field_and_bad_records(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["x"], field="content")
    assert [t for t, _ in iter_documents([path], text_field="content")] == ["x"]
    with pytest.raises(UserError, match="no field 'text'"):
        list(iter_documents([path]))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:2: not valid JSON"):
        list(iter_documents([tmp_path / "bad.jsonl"]))


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 ok \xff\xfe end " * 3)
    (tmp_path / "b.txt").write_text("already has \ufffd: not counted")  # only replacements made here count
    manifest = run([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "out")
    assert manifest["replaced_bytes"] == 9
    docs = split_documents(tmp_path / "out", manifest, "train") + split_documents(tmp_path / "out", manifest,
                                                                                  "validation")
    assert "caf\ufffd ok \ufffd\ufffd end " * 3 in docs


@pytest.mark.parametrize("data", [b"", b"ascii", b"\xe2\x82", b"a\xe2\x82\xacb\xc3", b"\xed\xa0\x80x", b"\xf0\x9f\x99"])
def test_decode_matches_python_replace(data):
    text, replaced = decode(data)
    assert text == data.decode("utf-8", "replace")
    assert replaced == text.count("\ufffd")  # these inputs hold no U+FFFD of their own


# ---------------------------------------------------------------- reuse


def test_reuse_refuse_and_overwrite(tmp_path):
    a, b, out = write_jsonl(tmp_path / "a.jsonl", sample_texts(8)), tmp_path / "b.txt", tmp_path / "out"
    b.write_text("a different dataset")
    first = run([a], out)
    before = snapshot(out)
    assert run([a], out) == first
    assert snapshot(out) == before  # nothing rewritten: same mtimes, same bytes

    with pytest.raises(UserError, match="different dataset.*overwrite"):
        run([b], out)
    assert snapshot(out) == before
    with pytest.raises(UserError, match="different dataset"):
        run([a], out, seed=1)  # settings are part of the fingerprint too

    second = run([b], out, overwrite=True)  # one document, too short for a tail
    assert second["fingerprint"] != first["fingerprint"]
    assert load_manifest(out) == second
    assert split_documents(out, second, "train") == ["a different dataset"]
    assert not (out / "validation_00000.bin").exists()  # one document: nothing stale left behind


def test_older_version_of_the_same_inputs_is_rebuilt_without_overwrite(tmp_path, monkeypatch, capsys):
    module = importlib.import_module("lm.data_prep.dataset")
    a, out = write_jsonl(tmp_path / "a.jsonl", sample_texts(8)), tmp_path / "out"
    monkeypatch.setattr(module, "VERSION", 1)  # as an lm prepare from before validation tails wrote it
    old = run([a], out)
    monkeypatch.undo()
    new = run([a], out)
    assert new["fingerprint"] != old["fingerprint"]
    assert "rebuilding" in capsys.readouterr().err


def test_data_an_older_prepare_wrote_still_loads(tmp_path, capsys):
    """A manifest from before validation by tokens (whole documents, none of the window fields) reads and trains as
    it is: the readers and the summary of a reuse need none of the new fields."""
    from lm.training.data import TokenStream

    a, out = write_jsonl(tmp_path / "a.jsonl", sample_texts(8)), tmp_path / "out"
    manifest = run([a], out)
    validation = manifest["splits"]["validation"]
    for key in ("seq_len", "windows", "min_windows", "cut"):
        del validation[key]
    validation["held_out"] = "whole documents"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert load_manifest(out) == manifest
    assert TokenStream(str(out), "train").total == manifest["splits"]["train"]["tokens"]
    capsys.readouterr()
    assert run([a], out) == manifest  # the same settings: reused, and summarised in one line
    assert capsys.readouterr().err.startswith(f"reusing {out}: train: ")


def test_corrupt_shard_is_rebuilt_on_rerun(tmp_path):
    a, out = write_jsonl(tmp_path / "a.jsonl", sample_texts(8)), tmp_path / "out"
    first = run([a], out)
    shard = out / "train_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    assert run([a], out) == first
    assert sha256_file(shard) == first["splits"]["train"]["shards"][0]["sha256"]


# ---------------------------------------------------------------- verification


def test_load_manifest_detects_damage(tmp_path):
    out = tmp_path / "out"
    manifest = run([write_jsonl(tmp_path / "a.jsonl", sample_texts(8))], out)
    shard = out / "train_00000.bin"
    good = shard.read_bytes()

    flipped = bytearray(good)
    flipped[3] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(UserError, match=r"corrupt shard .*train_00000\.bin: sha256 mismatch"):
        load_manifest(out)
    assert load_manifest(out, verify=False) == manifest  # size still right: only the hash can tell

    shard.write_bytes(good[:-1])
    with pytest.raises(UserError, match="bytes, manifest says"):
        load_manifest(out, verify=False)
    shard.unlink()
    with pytest.raises(UserError, match="missing shard"):
        load_manifest(out)

    shard.write_bytes(good)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="bad manifest"):
        load_manifest(out)
    (out / "manifest.json").write_text(json.dumps({**manifest, "format": "other/9"}))
    with pytest.raises(UserError, match="format"):
        load_manifest(out)
    (out / "manifest.json").unlink()
    with pytest.raises(UserError, match="manifest.json"):
        load_manifest(out)


# ---------------------------------------------------------------- bad input


def test_user_errors(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n\t\n")
    write_jsonl(tmp_path / "blank.jsonl", ["", "   "])
    out = tmp_path / "out"
    with pytest.raises(UserError, match="empty corpus"):
        run([tmp_path / "blank.txt", tmp_path / "blank.jsonl"], out)
    assert not out.exists()  # failed before touching the output
    with pytest.raises(UserError, match="input not found"):
        run([tmp_path / "missing.txt"], out)
    with pytest.raises(UserError, match="no input files"):
        run([str(tmp_path / "*.csv")], out)
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(UserError, match="unknown file extension"):
        run([tmp_path / "data.csv"], out)
    with pytest.raises(UserError, match="val_fraction"):
        run([tmp_path / "blank.txt"], out, val_fraction=1.0)
    with pytest.raises(UserError, match="too small"):
        run([tmp_path / "blank.txt"], out, vocab_size=100)
    (tmp_path / "bad.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UserError, match="cannot read"):
        run([tmp_path / "bad.txt.gz"], out)


def test_unreachable_dataset_and_hub_tokenizer(tmp_path, offline):
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(UserError, match="cannot load dataset 'no-such/dataset'"):
        run([], tmp_path / "out", dataset="no-such/dataset")
    with pytest.raises(UserError, match="cannot load tokenizer 'no-such/tokenizer'"):
        run([tmp_path / "a.txt"], tmp_path / "out", tokenizer="no-such/tokenizer")


# ---------------------------------------------------------------- tokenizer


def test_given_tokenizer_file(tmp_path):
    texts = sample_texts(8)
    first = run([write_jsonl(tmp_path / "a.jsonl", texts)], tmp_path / "first", vocab_size=320)
    path = tmp_path / "first" / "tokenizer.json"
    manifest = run([write_jsonl(tmp_path / "b.jsonl", texts[:4])], tmp_path / "second", tokenizer=str(path))
    vocab = Tokenizer.from_file(str(path)).get_vocab_size()
    assert manifest["tokenizer"]["vocab_size"] == first["tokenizer"]["vocab_size"] == vocab <= 320  # tiny corpus
    assert manifest["tokenizer"]["sha256"] == first["tokenizer"]["sha256"]
    with pytest.raises(UserError, match="tokenizer file not found"):
        run([tmp_path / "a.jsonl"], tmp_path / "third", tokenizer=str(tmp_path / "nope.json"))


def test_separator_choice():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2}, unk_token="[UNK]"))
    assert separator(tok) == ("</s>", 2)
    with pytest.raises(UserError, match="separator"):
        separator(Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))


def test_token_dtype():
    assert token_dtype(300) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == token_dtype(200_000) == "uint32"


# ---------------------------------------------------------------- shards


def test_small_shards_concatenate_to_the_single_shard(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", sample_texts(30))
    single = run([a], tmp_path / "one")
    many = run([a], tmp_path / "many", shard_tokens=50)
    for split in ("train", "validation"):
        one, parts = single["splits"][split], many["splits"][split]
        assert len(parts["shards"]) > 1 or parts["tokens"] <= 50
        assert all(s["tokens"] == 50 for s in parts["shards"][:-1])
        assert (parts["tokens"], parts["documents"]) == (one["tokens"], one["documents"])
        assert sum(s["documents"] for s in parts["shards"]) == parts["documents"]
        assert np.array_equal(split_tokens(tmp_path / "many", many, split), split_tokens(tmp_path / "one", single,
                                                                                          split))
    assert load_manifest(tmp_path / "many") == many


def documents_of(lengths: list[int]) -> list[np.ndarray]:
    """[sep, *tokens] arrays of these lengths (uint32), whose tokens number the corpus's content 1, 2, 3, ..."""
    firsts = np.cumsum([1] + [n - 1 for n in lengths])
    return [np.array([0, *range(first, first + n - 1)], np.uint32) for n, first in zip(lengths, firsts)]


def rejoined(train: np.ndarray, validation: np.ndarray) -> list[int]:
    """The corpus's tokens, in order, from the two splits: each split's documents, a cut one's head and tail joined."""
    documents = []
    for split in (train, validation):
        starts = [*np.flatnonzero(split == 0), len(split)]
        documents += [split[a + 1:b].tolist() for a, b in zip(starts, starts[1:])]
    return sorted(token for doc in documents for token in doc)


def test_split_rules(tmp_path):
    assert draw(7, 0) == draw(7, 0) != draw(7, 1)
    assert 0.45 < np.mean([draw(i, 0) for i in range(2000)]) < 0.55
    one = documents_of([20])  # the first document always trains: validation can only be cut from its end
    splits = write_splits(one, tmp_path, "uint32", 100, seed=0, holdout=Holdout(0.5, seq_len=256))
    assert (splits["train"]["tokens"], splits["validation"]["shards"]) == (20, [])  # 10 tokens: less than a window
    splits = write_splits(one, tmp_path, "uint32", 100, seed=0, holdout=Holdout(0.5, seq_len=4))
    assert (splits["train"]["tokens"], splits["validation"]["tokens"]) == (11, 10)  # 2 windows of 4 + 1
    splits = write_splits(documents_of([3]), tmp_path, "uint32", 100, seed=0, holdout=Holdout(0.999999, seq_len=1))
    assert (splits["train"]["tokens"], splits["validation"]["tokens"]) == (2, 2)  # the head keeps a token


def test_validation_is_its_fraction_of_the_tokens_drawn_over_the_corpus(tmp_path):
    """Without a floor: 10% of the tokens, within a document of it, from documents all over the corpus; the seed
    chooses which; nothing lost, nothing twice."""
    lengths = [int(n) for n in np.random.default_rng(0).integers(20, 400, 300)]
    holdout = Holdout(0.1, seq_len=16, min_windows=0)
    splits = write_splits(documents_of(lengths), tmp_path, "uint32", 10_000, seed=0, holdout=holdout)
    train, val = split_tokens_of(tmp_path, splits, "train"), split_tokens_of(tmp_path, splits, "validation")
    assert int(0.1 * sum(lengths)) <= len(val) <= int(0.1 * sum(lengths)) + max(lengths)
    assert rejoined(train, val) == list(range(1, sum(lengths) - len(lengths) + 1))  # every content token once
    first_half = sum(lengths[:150]) - 150
    assert 0.3 < np.mean(val[val != 0] <= first_half) < 0.7  # spread over the corpus, not its end
    again = write_splits(documents_of(lengths), tmp_path, "uint32", 10_000, seed=0, holdout=holdout)
    assert again == splits  # deterministic
    other = write_splits(documents_of(lengths), tmp_path, "uint32", 10_000, seed=1, holdout=holdout)
    assert other["validation"]["shards"][0]["sha256"] != splits["validation"]["shards"][0]["sha256"]


def test_validation_holds_at_least_64_windows_taken_from_the_end(tmp_path):
    """1% of 100 documents is 2 windows of 64 tokens; the floor brings validation to 64 windows exactly, with the
    corpus's last documents, the first of them cut in two."""
    lengths = [300] * 100
    splits = write_splits(documents_of(lengths), tmp_path, "uint32", 10_000, seed=0,
                          holdout=Holdout(0.01, seq_len=64, min_windows=64))
    train, val = split_tokens_of(tmp_path, splits, "train"), split_tokens_of(tmp_path, splits, "validation")
    assert len(val) == 64 * 64 + 1 and splits["validation"]["windows"] == 64 and splits["validation"]["cut"]
    assert rejoined(train, val) == list(range(1, 299 * 100 + 1))
    assert val[-299:].tolist() == list(range(299 * 99 + 1, 299 * 100 + 1))  # the last document, whole


def test_the_floor_takes_at_most_a_quarter_of_a_small_corpus(tmp_path):
    """10 documents of 50 tokens: a quarter holds 7 windows of 16 tokens (+1), not 64; a corpus whose quarter holds
    no window keeps validation at its fraction."""
    splits = write_splits(documents_of([50] * 10), tmp_path, "uint32", 10_000, seed=0,
                          holdout=Holdout(0.01, seq_len=16, min_windows=64))
    assert (splits["validation"]["tokens"], splits["validation"]["windows"]) == (7 * 16 + 1, 7)
    assert splits["train"]["tokens"] == 500 - 7 * 16 - 1 + 1  # the cut document's tail brought its own separator
    splits = write_splits(documents_of([50]), tmp_path, "uint32", 10_000, seed=0,
                          holdout=Holdout(0.01, seq_len=16, min_windows=64))
    assert splits["validation"]["tokens"] == 0 and splits["train"]["tokens"] == 50


def split_tokens_of(directory: Path, splits: dict, split: str) -> np.ndarray:
    """A split's tokens straight from write_splits' entries (no manifest yet)."""
    shards = splits[split]["shards"]
    return np.concatenate([np.fromfile(directory / s["name"], np.uint32) for s in shards]) if shards else \
        np.empty(0, np.uint32)


def test_one_book_holds_validation_out_of_its_tail(tmp_path, capsys):
    text = write_book(tmp_path / "book.txt")
    out = tmp_path / "out"
    manifest = run([tmp_path / "book.txt"], out, val_fraction=0.05, seq_len=32)
    validation = json.loads((out / "manifest.json").read_text())["splits"]["validation"]
    train, val = split_tokens(out, manifest, "train"), split_tokens(out, manifest, "validation")
    assert validation["documents"] == 1 and validation["cut"]
    # disjoint and lossless: the head in train and the tail in validation are the book's tokens, each once
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    book = tok.encode(text, add_special_tokens=False).ids
    assert train[0] == val[0] == 0 and [*train[1:], *val[1:]] == book
    assert len(val) == 64 * 32 + 1 > 0.05 * (len(book) + 1)  # the floor: 64 windows of 32
    assert f"validation: 1 documents, {len(val):,} tokens ({100 * len(val) / (len(book) + 2):.2g}% of the tokens), " \
           "64 windows of --seq_len 32, one of its documents the tail of a training document" in capsys.readouterr().err


def test_signature_works_with_jsonargparse():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_function_arguments(prepare)
    cfg = parser.parse_args(["--inputs", "[a.txt, data/]", "--out", "x", "--vocab_size", "512"])
    assert (list(cfg.inputs), cfg.out, cfg.vocab_size, cfg.overwrite) == (["a.txt", "data/"], "x", 512, False)


def test_the_tokenizer_trainer_leaves_no_blank_lines_on_a_stdout_that_is_no_terminal(capfd):
    """tokenizers' progress bars draw on stdout: where that is a log or a pipe (`lm demo > out`) they left blank lines
    around the summary, so they are drawn on a terminal alone."""
    from lm.data_prep.tokenizer import train_bpe

    train_bpe(["In the beginning God created the heaven and the earth."] * 200, vocab_size=300, progress=True)
    assert capfd.readouterr().out == ""

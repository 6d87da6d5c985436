"""lm.bench.data_speed on the bundled corpus: the same documents go through both tokenizing methods, and the
figures agree with each other (no speed is asserted)."""

import math
import re

from lm.bench.data_speed import bench_data
from lm.data_prep.shards import load_manifest


def test_bench_data_figures(kjv_data, tmp_path, capsys):
    result = bench_data(data=kjv_data, seq_len=32, micro_batch=2, batches=20, d_model=32, n_layers=1, n_heads=2,
                        head_dim=16, train_steps=1, repeats=1, prepare_workers=[1, 2], prepare_batch_docs=300,
                        json_out=str(tmp_path / "data.json"))
    manifest = load_manifest(kjv_data)
    splits = manifest["splits"].values()
    # Every document, each with its separator token in the shards: the bench tokenized exactly the prepared text
    # (a document cut in two for validation has a separator in each split: lm/data_prep/holdout.py).
    cut = manifest["splits"]["validation"].get("cut", False)
    assert result["documents"] + cut == sum(s["documents"] for s in splits)
    assert result["tokens"] + result["documents"] + cut == sum(s["tokens"] for s in splits)
    assert math.isclose(result["loader_over_train"], result["loader_tokens_per_s"] / result["train_tokens_per_s"])
    assert math.isclose(result["mixture_loader_over_train"],
                        result["mixture_loader_tokens_per_s"] / result["train_tokens_per_s"])
    assert math.isclose(result["data_prep_over_encode_batch"],
                        result["data_prep_tokens_per_s"] / result["encode_batch_tokens_per_s"])
    assert min(result["whole_prepare_tokens_per_s"], result["loader_tokens_per_s"]) > 0
    assert result["first_prepare_s"] is None  # given a prepared directory, nothing was prepared first
    workers = result["prepare_workers"]
    assert list(workers["runs"]) == ["1", "2", "1 (one thread)"] and workers["runs"]["1"]["speedup"] == 1
    assert workers["runs"]["1 (one thread)"]["over_one_thread"] == 1
    two = workers["runs"]["2"]
    assert math.isclose(two["speedup"], workers["runs"]["1"]["seconds"] / two["seconds"])
    assert math.isclose(two["tokens_per_s_per_core"] * workers["cores"], two["tokens_per_s"])
    # While it ran, stderr named each part as it started (lm.bench.progress).
    said = [line.strip() for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.strip()]
    named = [m[1] for line in said if (m := re.match(r"lm bench data: ([a-z][^:]*):", line))]
    assert list(dict.fromkeys(named)) == ["data loader", "data loader over a mixture", "training steps", "tokenizing",
                                          "lm prepare", "lm prepare --workers"], said
    assert " 6/6 " in said[-1], said

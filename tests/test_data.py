"""The training stream: every window once per epoch across ranks and workers, exact resume at any position,
the same global order at any world size; validation in order; corrupt shards refused."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lm.training.data import (
    DataConfig,
    TokenStream,
    TrainWindows,
    ValidationWindows,
    count_windows,
)
from lm.training.data_module import TokenDataModule
from lm.util.errors import UserError

SEQ = 64


@pytest.fixture(scope="module")
def stream(kjv_data) -> TokenStream:
    return TokenStream(kjv_data, "train")


def window_ids(stream, batch: torch.Tensor) -> list[int]:
    """Which window each row of a micro-batch is (windows start at multiples of SEQ); of windows whose tokens are the
    same (a passage the corpus repeats), the first."""
    ids = []
    for row in batch.numpy():
        matches = [w for w in candidate_windows(stream, row)]
        assert matches and all(stream._first[w] == matches[0] for w in matches)
        ids.append(matches[0])
    return ids


def candidate_windows(stream, row):
    key = tuple(row[:8])
    for w in stream._index.get(key, []):
        if np.array_equal(stream.read(w * SEQ, SEQ + 1), row):
            yield w


@pytest.fixture(scope="module")
def indexed(stream):
    """Map the first tokens of every window to its index (so loader output can be traced back)."""
    n = count_windows(stream.total, SEQ)
    stream._index, stream._first, firsts = {}, {}, {}
    for w in range(n):
        stream._index.setdefault(tuple(stream.read(w * SEQ, 8)), []).append(w)
        stream._first[w] = firsts.setdefault(stream.read(w * SEQ, SEQ + 1).tobytes(), w)  # a repeat: the first
    return stream


def global_order(stream, world: int, workers: int, micro_batch: int, start: int, n_steps: int) -> list[int]:
    """Windows in the order the whole world consumes them: micro-step by micro-step, rank by rank, each rank
    reading through a real DataLoader with worker processes."""
    loaders = [iter(DataLoader(TrainWindows(stream, SEQ, micro_batch, seed=7, start=start, rank=r, world=world),
                               batch_size=None, num_workers=workers)) for r in range(world)]
    per_step = [[window_ids(stream, next(loader)) for loader in loaders] for _ in range(n_steps)]
    # Within a micro-step, rank r holds positions r, r + world, ...: interleave the ranks back.
    order = []
    for ranks in per_step:
        for u in range(micro_batch):
            order += [ranks[r][u] for r in range(world)]
    return order


def test_every_window_once_per_epoch_across_2_ranks_and_2_workers(indexed):
    n = count_windows(indexed.total, SEQ)
    micro_batch, world = 8, 2
    steps = -(-n // (micro_batch * world))
    order = global_order(indexed, world=world, workers=2, micro_batch=micro_batch, start=0, n_steps=steps)
    first_epoch = order[:n]
    assert sorted(first_epoch) == sorted(indexed._first[w] for w in range(n))  # each window exactly once
    assert first_epoch != list(range(n))  # and shuffled


def test_resume_and_world_size_change_keep_the_global_order(indexed):
    reference = global_order(indexed, world=1, workers=0, micro_batch=4, start=0, n_steps=12)  # 48 windows
    assert global_order(indexed, world=2, workers=2, micro_batch=3, start=0, n_steps=8) == reference
    for start in (5, 16, 31):  # resume anywhere, with another world size and batch
        resumed = global_order(indexed, world=2, workers=1, micro_batch=2, start=start, n_steps=4)
        assert resumed == reference[start:start + 16]


def test_next_epoch_uses_a_new_permutation(indexed):
    n = count_windows(indexed.total, SEQ)
    windows = TrainWindows(indexed, SEQ, micro_batch=1, seed=7, start=0)
    epoch0 = [windows.window(p)[1] for p in range(n)]
    epoch1 = [windows.window(p)[1] for p in range(n, 2 * n)]
    assert sorted(epoch1) == list(range(n)) and epoch1 != epoch0
    # A single source keeps the order it always had (docs/design.md, "Data": seeded by (seed, epoch)), so an older
    # checkpoint resumes onto the same windows.
    assert epoch0 == np.random.default_rng([7, 0]).permutation(n).tolist()
    assert epoch1 == np.random.default_rng([7, 1]).permutation(n).tolist()


def test_windows_overlap_by_one_token_so_every_token_is_a_target_once(stream):
    a = stream.read(0, SEQ + 1)
    b = stream.read(SEQ, SEQ + 1)
    assert a[-1] == b[0]


def test_reads_cross_shard_boundaries(tmp_path):
    from lm.data_prep.prepare import prepare

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"text": "document number {i} says hello to the world {i}"}}\n' for i in range(60)))
    prepare([str(docs)], str(tmp_path / "one"), vocab_size=300, progress=False)
    many = prepare([str(docs)], str(tmp_path / "many"), vocab_size=300, shard_tokens=37, progress=False)
    assert len(many["splits"]["train"]["shards"]) > 3
    s1, s2 = TokenStream(str(tmp_path / "one"), "train"), TokenStream(str(tmp_path / "many"), "train")
    assert s1.total == s2.total
    for start, length in [(0, 100), (30, 50), (36, 2), (s1.total - 40, 40)]:
        assert np.array_equal(s1.read(start, length), s2.read(start, length))


def test_validation_windows_are_in_order_and_limited(kjv_data):
    val = TokenStream(kjv_data, "validation")
    windows = ValidationWindows(val, SEQ, limit=5)
    assert len(windows) == 5
    assert torch.equal(windows[2], torch.from_numpy(val.read(2 * SEQ, SEQ + 1)))


def test_data_module_state_is_the_window_count(kjv_data):
    dm = TokenDataModule(DataConfig(path=kjv_data, seq_len=SEQ, micro_batch=2, num_workers=0))
    dm.windows_consumed = 42
    other = TokenDataModule(DataConfig(path=kjv_data, seq_len=SEQ, micro_batch=2, num_workers=0))
    other.load_state_dict(dm.state_dict())
    assert other.windows_consumed == 42
    assert torch.equal(next(iter(other.train_dataloader())), next(iter(dm.train_dataloader())))


def test_corrupt_shard_and_too_long_windows_are_user_errors(kjv_data, tmp_path):
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(kjv_data, copy)
    with pytest.raises(UserError, match="longer|less than one window"):
        TokenDataModule(DataConfig(path=str(copy), seq_len=10**8))
    shard = next(copy.glob("train_*.bin"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="sha256"):
        TokenDataModule(DataConfig(path=str(copy), seq_len=SEQ))
    with pytest.raises(UserError):
        TokenDataModule(DataConfig(path=str(Path(tmp_path) / "missing"), seq_len=SEQ))


@pytest.fixture(scope="module")
def no_validation(tmp_path_factory) -> str:
    """One short document: too short for a tail, so lm prepare leaves the validation split empty."""
    from lm.data_prep.prepare import prepare

    tmp = tmp_path_factory.mktemp("short")
    (tmp / "note.txt").write_text("A short note of a few dozen words, written once and read once. " * 3)
    out = tmp / "data"
    manifest = prepare([str(tmp / "note.txt")], str(out), vocab_size=300, progress=False)
    assert manifest["splits"]["validation"]["tokens"] == 0 and manifest["splits"]["train"]["tokens"] > 4 * 8
    return str(out)


def test_empty_or_short_validation_split_is_a_one_line_error(no_validation, kjv_data):
    with pytest.raises(UserError, match=r"validation split of .* is empty: prepare it again .* data\.val_windows 0"
                       ) as empty:
        TokenDataModule(DataConfig(path=no_validation, seq_len=8))
    with pytest.raises(UserError, match="less than one window .* data.val_windows 0") as short:
        TokenDataModule(DataConfig(path=kjv_data, seq_len=100_000))  # training has windows; validation has none
    assert "\n" not in str(empty.value) + str(short.value)
    with pytest.raises(UserError, match="val_windows"):
        DataConfig(val_windows=-1)


def test_val_windows_0_trains_without_validation(no_validation, tmp_path, capsys, recwarn):
    from lm.cli import main

    config = tmp_path / "train.yaml"
    config.write_text(f"""
model: {{vocab_size: 300, d_model: 16, n_layers: 1, n_heads: 2, head_dim: 8, max_seq_len: 8}}
data: {{path: {no_validation}, seq_len: 8, micro_batch: 2, num_workers: 0}}
trainer: {{max_steps: 2, val_every: 1, ckpt_every: 2, log_every: 1, progress_bar: false}}
strategy: {{accelerator: cpu, devices: 1}}
run_dir: {tmp_path / "run"}
""")
    assert main(["train", "--config", str(config)]) == 2
    assert "validation split" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was written
    recwarn.clear()
    assert main(["train", "--config", str(config), "--data.val_windows", "0"]) == 0
    assert not [str(w.message) for w in recwarn if "zero" in str(w.message)]  # no warning of an empty loader
    (metrics,) = (tmp_path / "run").glob("logs/version_*/metrics.csv")
    assert "train/loss" in metrics.read_text() and "val/loss" not in metrics.read_text()

"""`lm bench checkpoint-save`: lm's streamed save needs no copy of the checkpoint in memory and writes nothing
outside the run directory, where Lightning's writer holds the whole checkpoint in memory and stages it in the temp
directory (the measurement must see that, or it measures nothing)."""

from lm.bench.checkpoint_save import bench_checkpoint_save


def test_a_save_streams_into_the_run_directory_alone():
    rows = {row["writer"]: row for row in bench_checkpoint_save(d_model=128, n_layers=2, vocab=16384)}
    size = rows["lm"]["checkpoint_mb"] * 2**20
    assert rows["lm"]["checkpoint_mb"] == rows["lightning"]["checkpoint_mb"] > 20
    assert rows["lm"]["extra_memory_ratio"] < 0.1
    assert rows["lm"]["bytes_outside_run_dir"] == 0
    assert rows["lightning"]["extra_memory_ratio"] > 0.8
    assert rows["lightning"]["bytes_outside_run_dir"] >= 0.99 * size

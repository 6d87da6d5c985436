"""`lm demo` end to end (shortened): bundled corpus -> shards -> training -> evaluation -> sample."""

from lm.demo import demo


def test_demo_runs_end_to_end_and_beats_the_unigram_bar(tmp_path, capsys):
    summary = demo(run_dir=str(tmp_path / "demo"), max_steps=30, progress=False, sample_tokens=12)
    out = capsys.readouterr().out
    assert "validation ppl" in out and "unigram ppl" in out and "sample:" in out
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 8 * 256
    assert summary["val_ppl"] < summary["unigram_ppl"]
    assert summary["tokens_per_s"] > 0
    assert (tmp_path / "demo" / "eval" / "ppl-validation-T256" / "per_position.png").exists()


def test_demo_ends_by_pointing_to_the_comparison(capsys):
    from lm.demo import print_summary

    summary = {"mixer": "attention", "steps": 1, "tokens": 8, "val_ppl": 2.0, "unigram_ppl": 3.0, "tokens_per_s": None,
               "wall_s": 1.0, "checkpoint": "c.ckpt"}
    print_summary(summary, "And God said")
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("next: `lm compare demo`")

"""`lm demo` end to end (shortened): bundled corpus -> shards -> training -> evaluation -> sample; its console: the
summary names where each file went, with no raw JSON and no library banners around it."""

from lm.cli.demo import demo

NOISE = ["GPU available", "TPU available", "💡 Tip", "litlogger", "LeafSpec", "Trainer.fit` stopped",
         "Setting accelerator to CPU"]


# Validation over unigram ppl after 50 steps: 0.48-0.57 over seeds 0-4 (configs/demo.yaml's seed is 0; Dec 5 2026,
# one thread). After 30 steps, all in the warmup, it was 0.67-1.07 (seed 4 did not beat the bar); after 40, 0.53-0.76.
STEPS = 50


def test_demo_runs_end_to_end_and_beats_the_unigram_bar(tmp_path, capfd, one_thread):
    summary = demo(run_dir=str(tmp_path / "demo"), max_steps=STEPS, progress=False, sample_tokens=12)
    captured = capfd.readouterr()  # the file descriptors: libraries' handlers hold streams of their own
    out = captured.out
    assert "validation ppl" in out and "unigram ppl" in out and "sample:" in out
    assert summary["steps"] == STEPS and summary["tokens"] == STEPS * 8 * 256
    assert summary["val_ppl"] < summary["unigram_ppl"], summary
    assert summary["tokens_per_s"] > 0
    run = tmp_path / "demo"
    assert (run / "eval" / "ppl-validation-T256" / "per_position.png").exists()
    # The summary says where each file went, and each is there.
    places = {"run directory": run, "data": run / "data", "checkpoint": run / "checkpoints" / f"step={STEPS:08d}.ckpt",
              "evaluation": run / "eval" / "ppl-validation-T256", "sample": run / "sample.txt"}
    for name, path in places.items():
        (line,) = [line for line in out.splitlines() if line.strip().startswith(name + "  ")]
        assert line.split()[len(name.split())] == str(path) and path.exists(), (name, line)
    printed = out.split("sample:\n")[1].split("\n\n")[0].splitlines()  # the indented block, every line of it
    assert (run / "sample.txt").read_text().splitlines() == [line.removeprefix("  ") for line in printed]
    # Nothing but lm's own lines: no evaluation JSON, no banners, tips or known deprecations, on either stream.
    assert not [line for line in out.splitlines() if line.lstrip().startswith("{")], out
    assert not [noise for noise in NOISE if noise in out + captured.err], captured.err


def test_demo_ends_by_pointing_to_the_comparison(capsys):
    from lm.cli.demo import print_summary

    summary = {"mixer": "attention", "steps": 1, "tokens": 8, "val_ppl": 2.0, "unigram_ppl": 3.0, "tokens_per_s": None,
               "wall_s": 1.0, "run_dir": "r", "data": "r/data", "checkpoint": "c.ckpt", "eval": "r/eval/e",
               "sample": "r/sample.txt"}
    print_summary(summary, "And God said\nunto Moses")
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("next: `lm compare demo`")
    assert "sample:\n  And God said\n  unto Moses\n\n" in out  # a sample's every line is indented, as one block

"""lm.training.preflight: what `lm train` checks before it imports Lightning. A config mistake in a fresh process is one
line and exit 2 without torch (nor Lightning) ever loaded; a resume on another learning-rate schedule is refused in
one line with nothing written, unless trainer.allow_schedule_change, and then the run's record notes the change; a
validation split smaller than `lm prepare`'s floor is said in one line. (That nothing of torch or Lightning is
imported on the way: tests/test_layers.py.)"""

import json
import subprocess
import sys

import pytest
from strategy_runs import train_here
from test_bad_input import tree_state, tree_times
from test_train import config_file

from lm.data_prep.holdout import Holdout
from lm.training.config import parse_run_config
from lm.training.data import TokenStream, count_windows
from lm.training.preflight import preflight

PROBE = ("import sys; from lm.cli import main; code = main(sys.argv[1:]); "
         "print(sorted(m for m in ('torch', 'lightning', 'deepspeed', 'transformers') if m in sys.modules)); "
         "sys.exit(code)")


def test_a_config_mistake_in_a_fresh_process_is_one_line_exit_2_without_torch(tmp_path):
    """The one launch of a process here: what it costs to start is the point (an unknown mixer used to import
    Lightning first, then torch; docs/training.md has the times)."""
    config = tmp_path / "bad.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nmodel: {{mixer: kdaa}}\n")
    done = subprocess.run([sys.executable, "-c", PROBE, "train", "--config", str(config)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [done.stderr.strip()] and \
        done.stderr.startswith("lm train: error: unknown mixer 'kdaa'; known: "), done.stderr
    assert done.stdout.splitlines() == ["[]"]  # none of them was imported
    assert not (tmp_path / "run").exists()


def test_a_resume_on_another_schedule_is_refused_unless_allowed_and_then_recorded(kjv_data, tmp_path):
    run = tmp_path / "run"
    config = config_file(tmp_path, kjv_data, run, max_steps=2, ckpt_every=2, val_every=2)
    assert train_here(config, run).returncode == 0
    before, times = tree_state(tmp_path), tree_times(tmp_path)
    for change, said in ((["--trainer.max_steps", "4"], "trainer.max_steps 2 -> 4"),
                         (["--optim.lr", "1e-3"], "optim.lr 0.003 -> 0.001"),
                         (["--optim.warmup_steps", "5"], "optim.warmup_steps 2 -> 5"),
                         (["--optim.schedule", "wsd"], "optim.schedule cosine -> wsd")):
        refused = train_here(config, run, *change)
        err = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(err) == 1, (change, refused.stderr[-2000:])
        assert err[0].startswith(f"lm train: error: {run / 'checkpoints' / 'step=00000002.ckpt'} was trained under "
                                 f"another learning-rate schedule ({said}; the rate at step 2: "), err
        assert err[0].endswith("--trainer.allow_schedule_change true to continue on this schedule"), err
        assert tree_state(tmp_path) == before and tree_times(tmp_path) == times  # nothing written
    allowed = train_here(config, run, "--trainer.max_steps", "4", "--trainer.allow_schedule_change", "true")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert f"lm train: continuing {run / 'checkpoints' / 'step=00000002.ckpt'} on a changed learning-rate schedule " \
           "(trainer.max_steps 2 -> 4), as trainer.allow_schedule_change says; the run's record notes it" \
        in allowed.stderr.splitlines()
    launches = json.loads((run / "run_record.json").read_text())["launches"]
    assert [launch["step"] for launch in launches] == [0, 2]
    assert "schedule_change" not in launches[0] and launches[1]["schedule_change"] == {"trainer.max_steps": [2, 4]}
    assert (run / "checkpoints" / "step=00000004.ckpt").is_file()
    # The checkpoints of the new schedule carry it: resuming the finished run as it was launched changes nothing.
    again = train_here(config, run, "--trainer.max_steps", "4")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "schedule_change" not in json.loads((run / "run_record.json").read_text())["launches"][2]


@pytest.fixture()
def validation_tokens(kjv_data) -> int:
    return TokenStream(kjv_data, "validation", verify=False).total


def test_a_validation_split_smaller_than_the_floor_is_said_in_one_line(kjv_data, validation_tokens, tmp_path, capsys):
    """Fewer than `lm prepare`'s floor of windows of data.seq_len: a warning, unless data.val_windows is 0."""
    floor = Holdout.min_windows
    short = validation_tokens // (floor // 2)  # a window this long: about floor / 2 of them
    for seq_len, val_windows, warned in ((short, 8, True), (short, 0, False), (validation_tokens // (2 * floor), 8,
                                                                                 False)):
        config, _, _ = parse_run_config([
            "--run_dir", str(tmp_path / "run"), "--model.vocab_size", "512", "--model.d_model", "32",
            "--model.n_layers", "1", "--model.n_heads", "2", "--model.head_dim", "16",
            "--model.max_seq_len", str(seq_len), "--data.path", kjv_data, "--data.seq_len", str(seq_len),
            "--data.val_windows", str(val_windows), "--strategy.accelerator", "cpu"])
        preflight(config)
        err = capsys.readouterr().err.splitlines()
        windows = count_windows(validation_tokens, seq_len)
        assert err == ([f"lm train: warning: validation holds fewer than {floor} windows of data.seq_len {seq_len} "
                        f"({windows} in {kjv_data}): its loss will be noisy; prepare the data with a larger hold-out "
                        "(lm prepare --val_fraction), or set data.val_windows 0 to train without validation"]
                       if warned else []), (seq_len, val_windows, err)
    assert not (tmp_path / "run").exists()

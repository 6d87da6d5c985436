"""Progress of `lm train` (lm.training.callbacks.progress), from real runs in a subprocess: with stdout not a terminal,
a plain line at each launch's first optimizer step and then every log_every optimizer steps, each on its way as soon
as it is printed, and one after each validation;
on a terminal, a bar that counts steps (not Lightning's "Epoch 0/-2") and shows the validation loss. The step numbers
are metrics.csv's, and Lightning's banners and known deprecations stay off the console (lm.training.console)."""

import csv
import fcntl
import math
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

from test_train import config_file, last_launch_losses

CLOCK = r"\d+:\d\d:\d\d"
LINE = re.compile(rf"step (\d+)/20 \| loss (\d+\.\d{{4}}) \| tokens/s [\d,]+ \| elapsed {CLOCK} \| eta {CLOCK}")
VAL_LINE = re.compile(r"step (\d+)/20 \| val loss (\d+\.\d{4}) \| val ppl (\d+\.\d\d)")
NOISE = ["GPU available", "TPU available", "💡 Tip", "litlogger", "LeafSpec", "Trainer.fit` stopped",
         "Setting accelerator to CPU"]


def train_command(tmp_path: Path, kjv_data: str) -> list[str]:
    # 20 steps of 2 micro-batches: one line per optimizer step that is a multiple of 5, not one per micro-batch.
    config = config_file(tmp_path, kjv_data, tmp_path / "run", max_steps=20, log_every=5, accumulate=2,
                         val_every=10, ckpt_every=10, progress_bar=True)
    return [sys.executable, "-m", "lm.cli", "train", "--config", str(config)]


def test_without_a_terminal_a_line_at_the_first_step_and_every_log_every_steps_printed_as_it_happens(kjv_data,
                                                                                                     tmp_path):
    cmd = train_command(tmp_path, kjv_data)
    # Block-buffered, as a batch job's stdout is unless PYTHONUNBUFFERED says otherwise (this test's machine sets it).
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "OMP_NUM_THREADS": "1"}
    # SIGKILL after step 12: nothing buffered survives it, so the lines of steps 1, 5 and 10 were written when printed.
    # Step 1's says the run is moving before log_every steps have passed.
    killed = subprocess.run(cmd, env={**env, "LM_FAULTS": "kill@step:12"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [int(m[1]) for m in LINE.finditer(killed.stdout)] == [1, 5, 10], killed.stdout
    assert [int(m[1]) for m in VAL_LINE.finditer(killed.stdout)] == [10], killed.stdout  # validated every 10 steps
    # The rerun resumes at step 10 and goes on from there (its first step, 11, has a line), to the end: a whole run's
    # output has no bar either.
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [LINE.fullmatch(line) or VAL_LINE.fullmatch(line) for line in done.stdout.splitlines()]
    assert [line and (line.re is VAL_LINE, int(line[1])) for line in lines] == \
        [(False, 11), (False, 15), (False, 20), (True, 20)], done.stdout  # stdout holds these lines alone
    # The losses are the ones metrics.csv has for those steps: the CSV counts steps as the lines do.
    logged = last_launch_losses(tmp_path / "run")
    assert [float(line[2]) for line in lines[1:3]] == [round(logged[15], 4), round(logged[20], 4)]
    (val,) = [float(r["val/loss"]) for r in newest_metrics(tmp_path / "run") if r["val/loss"]]
    assert (float(lines[3][2]), float(lines[3][3])) == (round(val, 4), round(math.exp(val), 2))
    assert int(newest_metrics(tmp_path / "run")[-1]["step"]) == 20  # the last row: the last step, as step=20.ckpt
    assert (tmp_path / "run" / "checkpoints" / "step=00000020.ckpt").is_file()
    assert "Epoch" not in done.stdout + done.stderr
    assert not [noise for noise in NOISE if noise in killed.stdout + killed.stderr + done.stdout + done.stderr], \
        killed.stderr + done.stderr


def newest_metrics(run_dir: Path) -> list[dict]:
    """The rows of the newest launch's metrics.csv."""
    newest = max(run_dir.glob("logs/version_*"), key=lambda p: int(p.name.split("_")[1]))
    with open(newest / "metrics.csv") as f:
        return list(csv.DictReader(f))


def run_on_a_terminal(cmd: list[str], env: dict) -> tuple[int, str]:
    """(exit status, what cmd wrote) with its stdout a terminal (a pseudo-terminal)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a new pty has 0 columns
    process = subprocess.Popen(cmd, stdout=terminal, stderr=subprocess.DEVNULL, env=env)
    os.close(terminal)
    output = b""
    while select.select([controller], [], [], 300)[0]:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the process has closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    return process.wait(timeout=60), output.decode(errors="replace")


def test_on_a_terminal_the_bar_counts_optimizer_steps_also_after_a_resume(kjv_data, tmp_path):
    cmd = train_command(tmp_path, kjv_data)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    status, killed = run_on_a_terminal(cmd, {**env, "LM_FAULTS": "kill@step:12"})
    assert status == -signal.SIGKILL
    assert re.search(r"Training:  60%.*\| 12/20 \[.*step/s", killed), killed[-2000:]
    # The rerun resumes mid-epoch, from the step-10 checkpoint: its bar starts there and ends at max_steps.
    status, resumed = run_on_a_terminal(cmd, env)
    assert status == 0
    assert re.search(r"Training:  50%.*\| 10/20 \[", resumed) and re.search(r"Training: 100%.*\| 20/20 \[", resumed)
    assert re.search(r"Training: 100%.*\| 20/20 \[.*val/loss=\d", resumed)  # the validation after step 20
    assert "Epoch" not in killed + resumed and not LINE.search(killed + resumed)

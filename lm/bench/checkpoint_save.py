"""What a single-file checkpoint save costs beyond the checkpoint itself (`lm bench checkpoint-save`): lm's
streamed writer (lm.training.checkpoint_io.StreamingCheckpointIO) against Lightning's TorchCheckpointIO, on the same
checkpoint of a real LMModule (its weights, AdamW's two moments, the Lightning keys).

Each writer saves in a fresh process of its own, so that nothing an earlier save freed can hide a later one's memory:
- extra host memory: the process's peak resident memory during the save (VmHWM, reset to the resident size just
  before it through /proc/self/clear_refs, after freed memory went back to the system) minus the resident size
  before, over the file's size. The weights and moments are filled with values first, so that every page of them is
  resident before;
- bytes written outside the run directory: the bytes the process handed to write() during the save (/proc/self/io,
  wchar) minus the bytes that the run directory gained. The process's temp directory (TMPDIR) is put on another
  filesystem than the run directory (/dev/shm), as a cluster node's often is: a file staged there and moved into
  the run directory is then copied, and its bytes count once outside and once inside.
"""

import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lm.bench.progress import each_run
from lm.bench.results import print_and_save
from lm.util.errors import UserError

WRITERS = ("lm", "lightning")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _written_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise OSError("no wchar in /proc/self/io")


def _checkpoint(d_model: int, n_layers: int, vocab: int) -> dict:
    """A Lightning checkpoint as Trainer.dump_checkpoint lays it out, of an attention model with AdamW's state."""
    from lm.model import LMConfig
    from lm.training.module import LMModule
    from lm.training.schedule import OptimConfig

    module = LMModule(LMConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=d_model // 64,
                               head_dim=64, mixer="attention"), OptimConfig(), max_steps=10)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.full_like(p, 1e-3),
                                  "exp_avg_sq": torch.full_like(p, 1e-6)}
    return {"epoch": 0, "global_step": 1, "pytorch-lightning_version": "bench", "state_dict": module.state_dict(),
            "loops": {}, "callbacks": {}, "optimizer_states": [optimizer.state_dict()], "lr_schedulers": [],
            "hyper_parameters": {"bench": True}}


def save_once(writer: str, run_dir: str, d_model: int, n_layers: int, vocab: int) -> dict:
    """One save by `writer` into `run_dir`, in this process; its figures."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lm.training.checkpoint_io import StreamingCheckpointIO

    checkpoint = _checkpoint(d_model, n_layers, vocab)
    io = StreamingCheckpointIO() if writer == "lm" else TorchCheckpointIO()
    path = Path(run_dir) / "checkpoints" / "step=00000001.ckpt"
    path.parent.mkdir(parents=True)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what was freed goes back to the system: resident is what is live
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the resident size (VmRSS)
    before, written_before = _status_bytes("VmRSS"), _written_bytes()
    io.save_checkpoint(checkpoint, path)
    peak, written = _status_bytes("VmHWM"), _written_bytes()
    size = path.stat().st_size
    in_run_dir = sum(p.stat().st_size for p in Path(run_dir).rglob("*") if p.is_file())
    return {"writer": writer, "checkpoint_mb": round(size / 2**20, 1),
            "extra_memory_ratio": round((peak - before) / size, 3),
            "bytes_outside_run_dir": written - written_before - in_run_dir}


def bench_checkpoint_save(d_model: int = 512, n_layers: int = 8, vocab: int = 32768,
                          json_out: str | None = None) -> list[dict]:
    """Extra host memory and bytes written elsewhere while one checkpoint is saved: lm's writer and Lightning's.

    Args:
        d_model: Width of the model (heads of 64).
        n_layers: Blocks.
        vocab: Vocabulary (rows of the tied embedding).
        json_out: Also write the rows as JSON here.
    """
    if d_model < 64 or d_model % 64 or n_layers < 1 or vocab < 2:
        raise UserError(f"--d_model must be a multiple of 64, --n_layers at least 1 and --vocab at least 2, got "
                        f"{d_model}, {n_layers} and {vocab}")
    if not Path("/proc/self/io").is_file():
        raise UserError("lm bench checkpoint-save reads /proc/self/io (Linux)")
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == Path(tempfile.gettempdir()).stat().st_dev:
        raise UserError("lm bench checkpoint-save needs /dev/shm on a filesystem of its own, for the temp directory")
    rows = []
    for writer in each_run(WRITERS, "lm bench checkpoint-save"):
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm) as other_tmp:
            code = (f"import json; from lm.bench.checkpoint_save import save_once; "
                    f"print(json.dumps(save_once({writer!r}, {tmp + '/run'!r}, {d_model}, {n_layers}, {vocab})))")
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": other_tmp})
            if result.returncode != 0:
                raise RuntimeError(f"the {writer} writer's save failed:\n{result.stderr[-2000:]}")
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    print_and_save(rows, json_out)
    return rows

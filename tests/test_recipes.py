"""Every shipped run config starts as a user starts it: `lm train --config FILE` with only the sizes shrunk to the CPU
(model width, vocabulary, window length, depth down to one layer pattern), the bundled corpus as data, 2 optimizer
steps and a checkpoint. The file's layout is kept: strategy, context_parallel, micro_batch, accumulation (the global
batch follows the world size so that it stays), layer pattern, mixer options and precision (a GPU recipe's default,
bf16-mixed, costs the CPU little at these sizes; data loader workers are none). Its processes come down
to at most MAX_PROCESSES, a context group whole: the long-context recipes' 8 GPUs (4 x 2 replicas) run as 4 processes
sharing each window, micro_batch 1 < N = 4.

A run config is any YAML under configs/ with model, data and trainer sections, so a new recipe is covered without
touching this file. Single-process configs train in this process, one after another (no imports per config);
several processes are launched as a user launches them, once for all the configs of a process count: the launch's
first `lm train` starts the other ranks as `lm train --config FILE` does (Lightning runs the launch's command again
in each), and the next configs train in those same processes, one after another (see `launch_together`)."""

import csv
import io
import json
import math
import os
import subprocess
import sys
import traceback
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import yaml
from strategy_runs import environment

from lm.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MAX_PROCESSES = 4
SEQ_LEN = 16  # divisible by every context_parallel up to 16
SHRUNK = {"model.vocab_size": 512, "model.d_model": 16, "model.n_heads": 2, "model.head_dim": 8,
          "model.max_seq_len": SEQ_LEN, "data.seq_len": SEQ_LEN, "data.num_workers": 0}


def run_configs() -> list[Path]:
    """The YAML files under configs/ that `lm train` takes: a mapping with model, data and trainer sections."""
    found = []
    for path in sorted(CONFIGS.rglob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if isinstance(raw, dict) and {"model", "data", "trainer"} <= raw.keys():
            found.append(path)
    return found


def layout(raw: dict) -> dict:
    """The file's layout at its world size, and the processes it runs on here: each context group whole, its
    replicas down to what MAX_PROCESSES holds (at least one)."""
    strategy, data, trainer = raw.get("strategy") or {}, raw["data"], raw["trainer"]
    devices = strategy.get("devices", 1)
    processes = (devices if isinstance(devices, int) else 1) * strategy.get("num_nodes", 1)
    pieces = strategy.get("context_parallel", 1)
    replicas = processes // pieces
    micro_batch = data["micro_batch"]
    global_batch = data.get("global_batch") or (data["global_batch_tokens"] // data["seq_len"]
                                                 if data.get("global_batch_tokens") else None)
    accumulate = global_batch // (micro_batch * replicas) if global_batch else trainer.get("accumulate") or 1
    replicas_here = min(replicas, max(1, MAX_PROCESSES // pieces))
    # The precision it trains in where it was meant to run: its own, else the default of its accelerator (bf16-mixed
    # on a GPU, which costs the CPU little at these sizes).
    precision = strategy.get("precision") or ("32-true" if strategy.get("accelerator") == "cpu" else "bf16-mixed")
    return {"pieces": pieces, "micro_batch": micro_batch, "accumulate": accumulate, "replicas": replicas_here,
            "processes": pieces * replicas_here, "precision": precision}


def pattern_of(raw: dict) -> list[str]:
    model = raw["model"]
    return model["layer_pattern"].split(",") if model.get("layer_pattern") else [model.get("mixer", "attention")]


def overrides(raw: dict, data: str, run_dir: Path) -> list[str]:
    """What a user adds to `lm train --config FILE`: the sizes, the data, the steps, the machine."""
    kept = layout(raw)
    settings = {**SHRUNK, "model.n_layers": len(pattern_of(raw)), "data.path": data,
                "data.global_batch": kept["micro_batch"] * kept["accumulate"] * kept["replicas"],
                "data.global_batch_tokens": "null", "data.val_windows": kept["micro_batch"] * kept["replicas"],
                "trainer.max_steps": 2, "trainer.ckpt_every": 2, "trainer.val_every": 2, "trainer.log_every": 1,
                "trainer.progress_bar": "false", "trainer.wandb": "false", "trainer.accumulate": "null",
                "strategy.accelerator": "cpu", "strategy.devices": kept["processes"], "strategy.num_nodes": 1,
                "strategy.precision": kept["precision"],
                "run_dir": str(run_dir)}
    return [item for key, value in settings.items() for item in (f"--{key}", str(value))]


CASES = {str(p.relative_to(CONFIGS)): p for p in run_configs()}


def test_every_kind_of_run_config_is_found():
    """The discovery finds the shipped recipes of each kind (it decides by content: a layout nobody listed is
    covered too), and no command's own settings."""
    assert {"demo.yaml", "attention/1b.yaml", "hawk_mesa/145m.yaml", "long_context/mesa_1b_32k.yaml",
            "ladder/cpu_base.yaml"} <= CASES.keys()
    assert not any(name.split("/")[0] in ("bench", "compare", "data") or name == "ladder/cpu.yaml" for name in CASES)
    assert any(layout(yaml.safe_load(p.read_text()))["processes"] > 1 for p in CASES.values())


def train_here(name: str, data: str, run_dir: Path) -> tuple[int, str]:
    """`lm train --config FILE` with the overrides, in this process: (exit status, what it wrote to stderr)."""
    path = CASES[name]
    argv = ["train", "--config", str(path), *overrides(yaml.safe_load(path.read_text()), data, run_dir)]
    with redirect_stderr(io.StringIO()) as stderr:
        try:
            code = main(argv)
        except Exception:
            traceback.print_exc()
            code = 1
    return code, stderr.getvalue()


def run_dir_of(out: Path, name: str) -> Path:
    return out / name.replace("/", "--").removesuffix(".yaml")


def launch_together(names: list[str], data: str, out: Path) -> dict[str, tuple[int | None, str]]:
    """The configs `names` (one process count) in one launch of `python tests/test_recipes.py DATA OUT NAME...`
    (this file's __main__): each rank trains them one after another, the first one's `lm train` starting the other
    ranks as a user's launch does. Each config's (exit status, rank 0's stderr); a config the launch did not get to:
    (None, the launch's stderr)."""
    launch = subprocess.run([sys.executable, __file__, data, str(out), *names], env=environment(),
                            capture_output=True, text=True, timeout=600)
    record = out / "results.json"
    done = json.loads(record.read_text()) if record.is_file() else {}
    said = f"the launch ended with {launch.returncode} before this config:\n{launch.stderr[-3000:]}"
    return {name: tuple(done[name]) if name in done else (None, said) for name in names}


@pytest.fixture(scope="module")
def launched(kjv_data, tmp_path_factory) -> dict[str, tuple[int | None, str, Path]]:
    """Every multi-process config's (exit status, stderr, run directory): one launch per process count."""
    by_count: dict[int, list[str]] = {}
    for name, path in CASES.items():
        processes = layout(yaml.safe_load(path.read_text()))["processes"]
        if processes > 1:
            by_count.setdefault(processes, []).append(name)
    results = {}
    for processes, names in sorted(by_count.items()):
        out = tmp_path_factory.mktemp(f"launch{processes}")
        results.update({name: (*result, run_dir_of(out, name))
                        for name, result in launch_together(names, kjv_data, out).items()})
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_every_shipped_config_starts(name, kjv_data, tmp_path, one_thread, request):
    path = CASES[name]
    raw = yaml.safe_load(path.read_text())
    kept, run_dir = layout(raw), tmp_path / "run"
    if kept["processes"] == 1:
        code, stderr = train_here(name, kjv_data, run_dir)
    else:
        code, stderr, run_dir = request.getfixturevalue("launched")[name]
    assert code == 0, stderr[-3000:]

    # The layout as the file has it: its context groups, micro-batch and accumulation; its replicas as many as fit.
    context = f" (context parallel: {kept['pieces']} processes share each window)" if kept["pieces"] > 1 else ""
    assert (f"lm train: {kept['replicas']} processes{context} x micro_batch {kept['micro_batch']} x accumulate "
            f"{kept['accumulate']} = ") in stderr, stderr[-3000:]
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    for section in ("strategy", "model"):
        for key in ("name", "context_parallel", "precision", "layer_pattern", "mixer", "mixer_options"):
            if key in raw.get(section, {}):
                assert resolved[section][key] == raw[section][key], (section, key)
    assert resolved["strategy"]["precision"] == kept["precision"]
    # 2 optimizer steps of `accumulate` micro-batches each on every rank (rank 0's count), finite losses, and the
    # step-2 checkpoint (a file, or FSDP2's directory of shards).
    with open(next(run_dir.glob("logs/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    assert max(int(r["train/batches"]) for r in rows if r.get("train/batches")) == 2 * kept["accumulate"]
    checkpoint = run_dir / "checkpoints" / "step=00000002.ckpt"
    assert checkpoint.exists()


if __name__ == "__main__":  # launch_together's launch: python tests/test_recipes.py DATA OUT NAME...
    data, out, *names = sys.argv[1:]
    results = {}
    for name in names:
        code, stderr = train_here(name, data, run_dir_of(Path(out), name))
        if os.environ.get("LOCAL_RANK", "0") == "0":  # rank 0 (Lightning sets LOCAL_RANK 0 there once it launches)
            results[name] = (code, stderr)
            Path(out, "results.json").write_text(json.dumps(results))
        if code != 0:
            sys.exit(code)

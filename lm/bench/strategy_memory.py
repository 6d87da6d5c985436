"""Memory per rank for parameters + gradients + optimizer state under DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 ranks).

Each strategy trains the same model for two steps through `lm train`'s own Trainer; after the last optimizer
step a callback counts the bytes of every live tensor storage in the process (each storage once), which is
what a rank holds for the model, its gradients, its optimizer state and the strategy's buffers. Tensors of
the data batch are a few KiB. DeepSpeed's ZeRO-3 also allocates its gradient reduction bucket up front
(reduce_bucket_size, 5e8 elements by default), so it is measured with the default and with small buckets.
Run: `lm bench strategies --data DIR` (one 2-process run per strategy).
"""

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch

from lm.bench.progress import each_run

VOCAB = 4096  # rows of the benchmark's embedding: the data's vocabulary must fit
STRATEGIES = {"ddp": ["--strategy.name", "ddp"],
              "zero2": ["--strategy.name", "deepspeed", "--strategy.zero_stage", "2"],
              "zero3": ["--strategy.name", "deepspeed", "--strategy.zero_stage", "3"],
              "zero3, 1M-element buckets": ["--strategy.name", "deepspeed", "--strategy.zero_stage", "3",
                                            "--strategy.deepspeed_config",
                                            "configs/deepspeed/zero3_small_buckets.json"],
              "fsdp2": ["--strategy.name", "fsdp"]}


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable by the garbage collector (parameters are tensors too)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            storage = obj.untyped_storage()
            pointer, size = storage.data_ptr(), storage.nbytes()
        except Exception:  # DTensor wrappers and freed storages refuse; their local shards are counted
            continue
        if pointer not in seen and size > 0:
            seen.add(pointer)
            total += size
    return total


class CountAfterStep(L.Callback):
    def __init__(self, out: Path):
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == trainer.max_steps:
            gc.collect()
            result = {"rank": trainer.global_rank, "bytes": live_tensor_bytes()}
            (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run_one(argv: list[str]) -> None:
    """One rank of one strategy (the entry point Lightning's launcher re-runs for rank 1)."""
    from lm.training.callbacks.graceful_stop import GracefulStop
    from lm.training.callbacks.stability import StabilityMonitor
    from lm.training.config import parse_run_config
    from lm.training.data_module import TokenDataModule
    from lm.training.module import LMModule
    from lm.training.preflight import batch_plan
    from lm.training.train import build_trainer

    out, argv = Path(argv[0]), argv[1:]
    config, _, _ = parse_run_config(argv)
    _, accumulate, _ = batch_plan(config)
    trainer = build_trainer(config, Path(config.run_dir), GracefulStop(), StabilityMonitor(), accumulate)
    trainer.callbacks.append(CountAfterStep(out))
    module = LMModule(config.model, config.optim, config.trainer.max_steps)
    trainer.fit(module, datamodule=TokenDataModule(config.data))


def bench_strategy_memory(data: str, d_model: int = 512, n_layers: int = 4, out: str | None = None) -> list[dict]:
    """Live tensor bytes per rank after two optimizer steps, for each strategy on 2 CPU processes.

    Args:
        data: A prepared data directory (lm prepare) with a vocabulary of at most 4096.
        d_model: Width of the model (heads of 64).
        n_layers: Blocks.
        out: Also write the rows as JSON here.
    """
    from lm.data_prep.shards import load_manifest
    from lm.util.errors import UserError

    vocab = load_manifest(data, verify=False)["tokenizer"]["vocab_size"]
    if vocab > VOCAB:
        raise UserError(f"--data {data} has a vocabulary of {vocab}; the benchmark's model has {VOCAB} rows")
    if d_model < 64 or d_model % 64 or n_layers < 1:
        raise UserError(f"--d_model must be a multiple of 64 (heads of 64) and --n_layers at least 1, got {d_model} "
                        f"and {n_layers}")
    if out is not None and (Path(out).is_dir() or not Path(out).resolve().parent.is_dir()):
        raise UserError(f"--out {out}: not a file in an existing folder")
    rows = []
    for name, flags in each_run(STRATEGIES.items(), "lm bench strategies", lambda strategy: strategy[0]):
        with tempfile.TemporaryDirectory() as tmp:
            argv = [tmp, "--run_dir", f"{tmp}/run", "--seed", "0",
                    "--model.vocab_size", str(VOCAB), "--model.d_model", str(d_model),
                    "--model.n_layers", str(n_layers), "--model.n_heads", str(d_model // 64), "--model.head_dim", "64",
                    "--model.max_seq_len", "64",
                    "--data.path", data, "--data.seq_len", "64", "--data.micro_batch", "2", "--data.num_workers", "0",
                    "--trainer.max_steps", "2", "--trainer.ckpt_every", "1000", "--trainer.val_every", "1000",
                    "--trainer.progress_bar", "false", "--strategy.accelerator", "cpu", "--strategy.devices", "2",
                    *flags]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
            subprocess.run([sys.executable, "-m", "lm.bench.strategy_memory", *argv], env=env, check=True,
                           capture_output=True)
            ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
        rows.append({"strategy": name, "bytes_per_rank": [r["bytes"] for r in ranks]})
    from lm.accounting.flops import param_count
    from lm.model import LMConfig
    from lm.util.output import write_json

    params = param_count(LMConfig(vocab_size=VOCAB, d_model=d_model, n_layers=n_layers, n_heads=d_model // 64,
                                  head_dim=64, max_seq_len=64))
    ddp = max(rows[0]["bytes_per_rank"])
    print(f"2 ranks, {params:,} parameters (fp32 weights + grads + 2 Adam moments = {16 * params / 2**20:.1f} MiB "
          f"unsharded): live tensor memory per rank after an optimizer step")
    print("| strategy | MiB per rank (rank 0, rank 1) | vs DDP |\n|---|---|---|")
    for r in rows:
        mib = ", ".join(f"{b / 2**20:.1f}" for b in r["bytes_per_rank"])
        print(f"| {r['strategy']} | {mib} | {max(r['bytes_per_rank']) / ddp:.2f} |")
    if out:
        write_json(out, rows)
    return rows


if __name__ == "__main__":
    run_one(sys.argv[1:])

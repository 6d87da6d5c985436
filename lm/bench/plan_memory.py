"""`lm bench plan-memory`: the per-GPU memory plan of run configs (lm.accounting.memory), the largest micro_batch that
fits each GPU size, with and without activation checkpointing; `--check` holds the plan to measured CPU peaks (the
bytes torch's CPU allocator hands out, lm.bench.memory.tracked_peak_bytes).

    lm bench plan-memory --configs '[configs/attention/1b.yaml, configs/mesa/1b.yaml]' --gpu_gib '[80, 141]'
    lm bench plan-memory --check true
"""

import gc
import glob
import json

import torch
import yaml

from lm.accounting.memory import STRATEGIES, micro_batch_fits, plan_memory
from lm.bench.memory import tracked_peak_bytes
from lm.bench.progress import each_run
from lm.mixers import MIXERS
from lm.mixers.context_parallel import check_layout
from lm.model import LanguageModel, LMConfig
from lm.training.module import next_token_loss
from lm.util.errors import UserError
from lm.util.output import write_json

MIB = 2**20

# (d_model, n_layers, vocab_size, seq_len, micro_batch): three small sizes where the CPU can measure a whole step.
CHECK_SIZES = [(256, 2, 8192, 512, 2), (384, 4, 16384, 1024, 2), (512, 4, 32768, 2048, 2)]


def measured_peak_bytes(cfg: LMConfig, micro_batch: int, seq_len: int) -> int:
    """Peak of the tensor memory that building the model and AdamW and running two fp32 training steps on the CPU
    holds at once: the bytes torch's CPU allocator hands out and takes back, tracked
    (lm.bench.memory.tracked_peak_bytes).
    Everything is allocated inside the measured window, so the figure does not depend on what the process did
    before; what is not a tensor (code, thread stacks, malloc's free lists) is not counted, as the plan does not."""
    gc.collect()
    torch.manual_seed(0)

    def build_and_train():
        train_steps(LanguageModel(cfg), torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1)), steps=2)

    return tracked_peak_bytes(build_and_train)


def train_steps(model: LanguageModel, windows: torch.Tensor, steps: int):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        next_token_loss(model, windows).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def check_against_cpu(mixers: list[str]) -> list[dict]:
    rows = []
    sizes = each_run(CHECK_SIZES, "lm bench plan-memory --check", lambda size: f"d_model {size[0]}, {size[1]} layers")
    for d, layers, vocab, T, b in sizes:
        for mixer in mixers:
            cfg = LMConfig(mixer=mixer, d_model=d, n_layers=layers, n_heads=d // 64, head_dim=64, vocab_size=vocab,
                           max_seq_len=T)
            measured = measured_peak_bytes(cfg, b, T)
            planned = plan_memory(cfg, b, T, precision="fp32").peak
            rows.append({"mixer": mixer, "d_model": d, "n_layers": layers, "vocab_size": vocab, "seq_len": T,
                         "micro_batch": b, "planned_mib": planned / MIB, "measured_mib": measured / MIB,
                         "planned_over_measured": planned / measured})
    print(json.dumps(rows, indent=2))
    print("\n| mixer | d_model | layers | vocab | T | micro_batch | planned MiB | measured MiB | planned / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mixer']} | {r['d_model']} | {r['n_layers']} | {r['vocab_size']} | {r['seq_len']} "
              f"| {r['micro_batch']} | {r['planned_mib']:.0f} | {r['measured_mib']:.0f} "
              f"| {r['planned_over_measured']:.3f} |")
    worst = max(abs(r["planned_over_measured"] - 1) for r in rows)
    print(f"\nlargest deviation {worst:.1%}")
    return rows


def model_of(path: str) -> tuple[LMConfig, dict, int]:
    """(the model, the data section, strategy.context_parallel) of a run config."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
        pieces = int((raw.get("strategy") or {}).get("context_parallel", 1))
        return LMConfig(**raw["model"]), raw.get("data", {}), pieces
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        raise UserError(f"cannot read the model of {path}: {err}") from None


def bench_plan_memory(configs: list[str] | None = None, seq_len: int | None = None, micro_batch: int | None = None,
                      gpu_gib: list[float] = [80, 141], strategy: str = "single", world_size: int = 1,  # noqa: B006
                      precision: str = "bf16-mixed", check: bool = False,
                      check_mixers: list[str] | None = None, context_parallel: int | None = None,
                      json_out: str | None = None):
    """The memory plan of each config at its micro_batch and seq_len (or the ones given), by component, and the
    largest micro_batch that fits each GPU size with and without activation checkpointing.

    Args:
        configs: Run config YAMLs (their `model` and `data` sections); a pattern such as configs/*/1b.yaml stands for
            the files it matches.
        seq_len: Tokens per sequence (default: each config's data.seq_len).
        micro_batch: Sequences per GPU per step (default: each config's data.micro_batch).
        gpu_gib: GPU memory sizes in GiB to fit (80 for an H100, 141 for an H200).
        strategy: single (one GPU), ddp, fsdp (FSDP2), zero2 or zero3 (DeepSpeed).
        world_size: GPUs the strategy shards over.
        precision: bf16-mixed (as on a GPU) or fp32.
        check: Instead, hold the plan to measured fp32 CPU peaks of whole training steps at three small sizes (the
            tensor memory torch's CPU allocator hands out, tracked).
        check_mixers: The mixers of the check (default: every mixer).
        context_parallel: GPUs that share each sequence, each holding seq_len / N tokens (default: each config's
            strategy.context_parallel, else 1); world_size counts them all.
        json_out: Also write the result as JSON to this path.
    """
    if strategy not in STRATEGIES or precision not in ("bf16-mixed", "fp32") or world_size < 1:
        raise UserError(f"strategy must be one of {', '.join(STRATEGIES)}, precision bf16-mixed or fp32, world_size "
                        f">= 1; got {strategy}, {precision}, {world_size}")
    if (seq_len is not None and seq_len < 1) or (micro_batch is not None and micro_batch < 1):
        raise UserError(f"--seq_len and --micro_batch must be >= 1, got {seq_len} and {micro_batch}")
    if check:
        unknown = set(check_mixers or []) - set(MIXERS)
        if unknown:
            raise UserError(f"--check_mixers must be among {', '.join(MIXERS)} (unknown: {sorted(unknown)})")
        result = check_against_cpu(check_mixers or list(MIXERS))
    else:
        if not configs:
            raise UserError("give --configs (run config YAMLs), or --check true")
        rows = []
        for path in [match for pattern in configs for match in sorted(glob.glob(pattern)) or [pattern]]:
            cfg, data, pieces = model_of(path)
            pieces = pieces if context_parallel is None else context_parallel
            T = seq_len or data.get("seq_len", cfg.max_seq_len)
            b = micro_batch or data.get("micro_batch", 1)
            check_layout(pieces, T, world_size, what=f"{path}: context_parallel", window="seq_len")
            kw = dict(strategy=strategy, world_size=world_size, precision=precision, context_parallel=pieces)
            rows.append({"config": path, "seq_len": T, "micro_batch": b, "context_parallel": pieces,
                         **plan_memory(cfg, b, T, **kw).gib(),
                         **micro_batch_fits(cfg, T, gpu_gib, **kw)})
        result = rows
        print(json.dumps(rows, indent=2))
        print(f"\nGiB per GPU ({strategy}, world size {world_size}, {precision}); fits: the largest micro_batch "
              "(with activation checkpointing)")
        fits = " | ".join(f"fits {g:g} GiB" for g in gpu_gib)
        print(f"\n| config | T | context parallel | micro_batch | weights | grads | optimizer | activations | logits "
              f"| Mesa CG | peak | {fits} |")
        print("|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(gpu_gib))
        for r in rows:
            fit = " | ".join(f"{r[f'fits_{g:g}gib']} ({r[f'fits_{g:g}gib_ckpt']})" for g in gpu_gib)
            print(f"| {r['config']} | {r['seq_len']} | {r['context_parallel']} | {r['micro_batch']} "
                  f"| {r['weights']:.1f} | {r['gradients']:.1f} "
                  f"| {r['optimizer']:.1f} | {r['activations']:.1f} | {r['logits']:.2f} | {r['mesa_cg']:.2f} "
                  f"| {r['peak']:.1f} | {fit} |")
    if json_out:
        write_json(json_out, result)
    return result

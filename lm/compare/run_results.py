"""One `lm train` run directory read back for `lm compare report`: its config.yaml (shape -> parameters and FLOPs),
the CSV logs under logs/ (losses, steps, throughput, time) and what `lm eval` wrote under eval/. A missing piece is
None or empty; only a path that is no run directory at all is an error."""

import csv
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lm.training.batch import global_batch_of
from lm.util.errors import UserError

# What lm.training.metrics_log writes into each launch's hparams.yaml: its rows count the optimizer steps done. The
# logs of older lm lack it; their rows were Lightning's count, one less (step s's loss and the validation after it).
STEPS_DONE_MARK = "metrics_step: optimizer_steps_done"
# Without a suite naming it, a task's main metric is the first of these that it reports.
MAIN_METRICS = ("acc", "acc_norm", "exact_match", "contains", "word_perplexity", "perplexity")
# Settings that say how or where a run was done, not what was trained: runs differing only in them are comparable.
BOOKKEEPING = ("run_dir", "seed", "optim.lr", "data.seed", "data.num_workers", "data.verify",
               "data.micro_batch", "data.global_batch", "data.global_batch_tokens", "trainer.accumulate",
               "trainer.ckpt_every", "trainer.keep_last", "trainer.log_every", "trainer.val_every",
               "trainer.activation_checkpointing", "trainer.compile", "trainer.progress_bar", "trainer.peak_flops",
               "trainer.wandb", "trainer.wandb_project", "trainer.wandb_mode", "strategy.")


@dataclass
class RunResults:
    path: str
    arch: str
    lr: float | None
    seed: int | None
    setting: dict  # what was trained (the flattened config less BOOKKEEPING), to tell comparable runs apart
    params: int
    params_without_embeddings: int
    flops_per_token: float  # training FLOPs per token: as spent where the run logged train/flops, else the analytic
    batch_tokens: int  # tokens per optimizer step: global batch x seq_len
    steps: int = 0
    train_loss: float | None = None
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (optimizer steps done, validation loss)
    tokens_per_s: float | None = None
    mfu: float | None = None
    wall_s: float | None = None
    nll_curves: dict[str, dict[int, float]] = field(default_factory=dict)  # eval folder -> {position: NLL}, newest 1st
    spent: tuple[int, float] | None = None  # (optimizer steps done, the training FLOPs spent by then: train/flops)
    harness: dict[str, float] = field(default_factory=dict)  # "task/metric" -> value
    longctx: dict[str, float] = field(default_factory=dict)  # "longctx-HAYSTACK/probe" -> mean accuracy
    grids: dict[str, list[dict]] = field(default_factory=dict)  # "longctx-HAYSTACK/probe" -> grid.csv rows

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_tokens

    @property
    def flops(self) -> float:
        return self.flops_per_token * self.tokens

    @property
    def val_loss(self) -> float | None:
        return self.val_curve[-1][1] if self.val_curve else None

    @property
    def val_ppl(self) -> float | None:
        return math.exp(min(self.val_loss, 700.0)) if self.val_loss is not None else None

    def nll_at(self, position: int) -> float | None:
        """The newest per-position curve at the logged position nearest at or below `position` (None beyond its
        length)."""
        curve = next(iter(self.nll_curves.values()), {})
        below = [p for p in curve if p <= position]
        return curve[max(below)] if below and position <= max(curve) else None


def number(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if value not in (None, "") else None


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def metric_files(run: Path) -> list[Path]:
    """Each launch's metrics.csv (CSVLogger: logs/version_N/), oldest launch first."""
    def version(path: Path) -> tuple[int, str]:
        name = path.parent.name
        return (int(name.split("_")[-1]) if name.split("_")[-1].isdigit() else -1, str(path))
    return sorted((run / "logs").rglob("metrics.csv"), key=version)


def median_of(rows: list[dict], key: str) -> float | None:
    values = [v for row in rows if (v := number(row, key)) is not None]
    return statistics.median(values) if values else None


def read_metrics(run: Path, results: RunResults) -> list[dict]:
    """Losses, steps, wall time, tokens/s and MFU from the CSV logs; returns all rows. A later launch (a resume)
    overrides what an earlier one logged at the same step."""
    rows, train, val, spent, wall = [], {}, {}, {}, []
    for path in metric_files(run):
        with open(path) as f:
            launch = list(csv.DictReader(f))
        rows += launch
        hparams = path.parent / "hparams.yaml"  # written when the launch started
        older = not (hparams.is_file() and STEPS_DONE_MARK in hparams.read_text())
        for row in launch:
            if (step := number(row, "step")) is None:
                continue
            done = int(step) + older  # optimizer steps done
            if number(row, "train/loss") is not None:
                train[done] = number(row, "train/loss")
            if number(row, "val/loss") is not None:
                val[done] = number(row, "val/loss")
            if number(row, "train/flops") is not None:
                spent[done] = number(row, "train/flops")
        times = [t for row in launch if (t := number(row, "train/time")) is not None]
        wall.append(max(times) if times else
                    path.stat().st_mtime - hparams.stat().st_mtime if hparams.exists() else None)
    results.steps = max([*train, *val], default=0)
    results.train_loss = train[max(train)] if train else None
    results.val_curve = [(s, val[s]) for s in sorted(val)]
    results.spent = (max(spent), spent[max(spent)]) if spent else None
    results.wall_s = sum(w for w in wall if w is not None) if any(w is not None for w in wall) else None
    # The throughput monitor logs a global rate only with more than one process; the device rate is then 1/world.
    results.tokens_per_s = median_of(rows, "train/items_per_sec") or median_of(rows, "train/device/items_per_sec")
    results.mfu = median_of(rows, "train/device/mfu")
    return rows


def world_size(strategy: dict, rows: list[dict]) -> int:
    """Processes of the run: from the config, or (devices: auto) from the ratio of global to device throughput."""
    devices, nodes = strategy.get("devices", 1), strategy.get("num_nodes", 1) or 1
    if isinstance(devices, int) and devices > 0:
        return devices * nodes
    world, device = median_of(rows, "train/items_per_sec"), median_of(rows, "train/device/items_per_sec")
    return max(1, round(world / device)) if world and device else nodes


def newest_checkpoint_step(run: Path) -> int:
    steps = [int(p.name[5:-5]) for p in (run / "checkpoints").glob("step=*.ckpt") if p.name[5:-5].isdigit()]
    return max(steps, default=0)


def read_ppl_curves(run: Path) -> dict[str, dict[int, float]]:
    """Each `lm eval ppl` output folder's per_position.csv as {position: NLL}, the newest folder first."""
    curves = {}
    for path in sorted((run / "eval").glob("ppl-*/per_position.csv"), key=lambda p: p.stat().st_mtime, reverse=True):
        with open(path) as f:
            curves[path.parent.name] = {int(row["position"]): float(row["nll"]) for row in csv.DictReader(f)}
    return curves


def main_metric(values: dict, named: str | None) -> tuple[str, float] | None:
    """(metric, value) of one task's lm-eval results: the one its suite names, else the first of MAIN_METRICS."""
    reported = {}
    for key, value in values.items():
        name, _, _ = key.partition(",")
        if "," in key and not name.endswith("_stderr") and isinstance(value, (int, float)):
            reported.setdefault(name, float(value))
    for name in ([named] if named else []) + list(MAIN_METRICS) + list(reported):
        if name in reported:
            return name, reported[name]
    return None


def read_harness(run: Path) -> dict[str, float]:
    from lm.eval.run_harness import load_suite

    scores = {}
    for path in sorted((run / "eval").glob("harness-*/results.json")):
        saved = json.loads(path.read_text())
        try:
            named = {t["task"]: t.get("metric") for t in load_suite(saved["suite"])["tasks"]} if saved.get("suite") \
                else {}
        except UserError:  # a suite YAML that has moved since: fall back to MAIN_METRICS
            named = {}
        for task, values in saved.get("results", {}).items():
            if (found := main_metric(values, named.get(task))) is not None:
                scores[f"{task}/{found[0]}"] = found[1]
    return scores


def read_longctx(run: Path, results: RunResults) -> None:
    for path in sorted((run / "eval").glob("longctx-*/grid.csv")):
        with open(path) as f:
            rows = list(csv.DictReader(f))
        for probe in dict.fromkeys(r["probe"] for r in rows):
            cells = [{"length": int(r["length"]), "depth": float(r["depth"]), "accuracy": float(r["accuracy"])}
                     for r in rows if r["probe"] == probe]
            results.grids[f"{path.parent.name}/{probe}"] = cells
            results.longctx[f"{path.parent.name}/{probe}"] = sum(c["accuracy"] for c in cells) / len(cells)


def arch_name(model) -> str:
    """The mixer, or a hybrid's layer pattern joined by "+" as `lm compare plan` names it ("mesa+attention")."""
    return "+".join(name.strip() for name in model.layer_pattern.split(",")) if model.layer_pattern else model.mixer


def check_run_dir(path: str) -> None:
    if not (Path(path) / "config.yaml").is_file():
        raise UserError(f"{path} is not a run directory (no config.yaml; `lm train` writes one into its run_dir)")


def read_run(path: str) -> RunResults:
    """Everything the report shows of one run directory."""
    from lm.accounting.flops import param_count, train_flops_per_token
    from lm.model import LMConfig

    check_run_dir(path)
    run = Path(path)
    config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    try:
        model = LMConfig(**config["model"])
        data = config["data"]
        seq_len = int(data["seq_len"])
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{run / 'config.yaml'} is not an `lm train` config ({type(err).__name__}: {err})") from None
    setting = {k: v for k, v in flatten(config).items() if not k.startswith(BOOKKEEPING)}
    results = RunResults(
        path=path, arch=arch_name(model),
        lr=config.get("optim", {}).get("lr"), seed=config.get("seed"), setting=setting,
        params=param_count(model), params_without_embeddings=param_count(model, embeddings=False),
        flops_per_token=train_flops_per_token(model, seq_len), batch_tokens=0)
    rows = read_metrics(run, results)
    results.steps = max(results.steps, newest_checkpoint_step(run))
    global_batch = global_batch_of(data.get("global_batch"), data.get("global_batch_tokens"), seq_len) or \
        data.get("micro_batch", 1) * (config.get("trainer", {}).get("accumulate") or 1) * \
        world_size(config.get("strategy", {}), rows)
    results.batch_tokens = global_batch * seq_len
    if results.spent is not None and results.spent[0] > 0:  # the FLOPs per token it spent (Mesa with cg_tol)
        results.flops_per_token = results.spent[1] / (results.spent[0] * results.batch_tokens)
    results.setting["tokens per step"] = results.batch_tokens
    results.nll_curves = read_ppl_curves(run)
    results.harness = read_harness(run)
    read_longctx(run, results)
    return results

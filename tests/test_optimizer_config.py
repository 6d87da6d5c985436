"""The optimizer a real run builds (lm.training.train: LMModule.configure_optimizers under Lightning), against the
config that sets it: the learning rate applied at every optimizer step against the schedules' formulas, written here
from their definitions (warmup, cosine; warmup, stable, decay; then the floor), and every parameter's AdamW weight
decay against optim.weight_decay, qk_weight_decay and vo_weight_decay."""

import math
from pathlib import Path

import lightning as L
import pytest
import torch

from lm.training.config import parse_run_config
from lm.training.train import train

STEPS = 12
EXTRA = 3  # steps past the run's end, where the schedule stays at its floor
# Values unlike the defaults, and unlike each other, so that a value read from the wrong field shows.
OPTIM = dict(lr=2.0e-3, init_lr=1.0e-4, warmup_steps=3, min_lr_ratio=0.2, decay_fraction=0.25,
             weight_decay=0.07, qk_weight_decay=0.3, vo_weight_decay=0.02)
# Every kind of parameter group: Hawk (its Lambda, a_param; block-diagonal gate matrices; a conv), attention (q/k,
# v/o), Mesa (its Lambda, lam_raw; beta and gamma projections; q/k convs), sliding-window attention (attention's
# groups, inherited); an untied head.
PATTERN = ["hawk", "attention", "mesa", "swa"]


def expected_lr(step: int, schedule: str) -> float:
    """The schedule's definition: linear warmup from init_lr to lr over warmup_steps; then cosine from lr to the
    floor lr * min_lr_ratio over the rest of the run, or (wsd) lr until the last decay_fraction of the run, linear
    decay to the floor over it; the floor from the run's end on."""
    peak, start, warmup = OPTIM["lr"], OPTIM["init_lr"], OPTIM["warmup_steps"]
    floor = peak * OPTIM["min_lr_ratio"]
    if step < warmup:
        return start + (peak - start) * step / warmup
    if step >= STEPS:
        return floor
    if schedule == "cosine":
        return floor + (peak - floor) * (1 + math.cos(math.pi * (step - warmup) / (STEPS - warmup))) / 2
    decaying = round(OPTIM["decay_fraction"] * STEPS)  # the last 3 of the 12 steps
    if step < STEPS - decaying:
        return peak
    return peak - (peak - floor) * (step - (STEPS - decaying)) / decaying


def expected_decay(name: str) -> float:
    """The config's decay of each parameter of PATTERN's model, by its name: attention's (and SWA's) query/key and
    value/output matrices their own, the other matrices weight_decay; norms, biases, the embedding, Hawk's and Mesa's
    Lambda and Mesa's beta/gamma projections none."""
    layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
    tail = name.split(".", 2)[-1] if layer is not None else name
    undecayed = ("embed.weight", "norm.weight", "mixer_norm.weight", "mlp_norm.weight", "mixer.norm.weight",
                 "mixer.a_param", "mixer.lam_raw", "mixer.beta_proj.weight", "mixer.gamma_proj.weight")
    if tail in undecayed or name.endswith(".bias"):
        return 0.0
    if layer is not None and PATTERN[layer % len(PATTERN)] in ("attention", "swa"):
        return {"mixer.q_proj.weight": OPTIM["qk_weight_decay"], "mixer.k_proj.weight": OPTIM["qk_weight_decay"],
                "mixer.v_proj.weight": OPTIM["vo_weight_decay"],
                "mixer.out_proj.weight": OPTIM["vo_weight_decay"]}.get(tail, OPTIM["weight_decay"])
    return OPTIM["weight_decay"]


class RecordOptimizer(L.Callback):
    """The learning rate of every group at each optimizer step (the one that step applies), and the optimizer, its
    scheduler and the model at the end."""

    def __init__(self):
        self.lrs: dict[int, list[float]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        assert trainer.global_step not in self.lrs  # one optimizer step per global step, also when accumulating
        self.lrs[trainer.global_step] = [group["lr"] for group in optimizer.param_groups]

    def on_train_end(self, trainer, pl_module):
        self.module, self.optimizer = pl_module, trainer.optimizers[0]
        self.scheduler = trainer.lr_scheduler_configs[0].scheduler


def fit(tmp_path: Path, data: str, schedule: str, accumulate: int) -> RecordOptimizer:
    run_dir = tmp_path / schedule
    config = tmp_path / f"{schedule}.yaml"
    optim = ", ".join(f"{k}: {v}" for k, v in {**OPTIM, "schedule": schedule}.items())
    config.write_text(f"""
run_dir: {run_dir}
seed: 5
model: {{vocab_size: 512, d_model: 32, n_layers: {len(PATTERN)}, n_heads: 2, head_dim: 16, max_seq_len: 32,
        layer_pattern: "{','.join(PATTERN)}", tie_embeddings: false, mixer_options: {{swa: {{window: 8}}}}}}
data: {{path: {data}, seq_len: 32, micro_batch: 2, num_workers: 0, val_windows: 0}}
optim: {{{optim}}}
strategy: {{accelerator: cpu}}
trainer: {{max_steps: {STEPS}, accumulate: {accumulate}, val_every: 100, ckpt_every: 100, log_every: 1,
          progress_bar: false}}
""")
    cfg, resume, yaml = parse_run_config(["--config", str(config)])
    record = RecordOptimizer()
    train(cfg, resume, yaml, callbacks=[record])
    return record


@pytest.fixture(scope="module")
def runs(kjv_data, tmp_path_factory) -> dict[str, RecordOptimizer]:
    """A run of each schedule; WSD's accumulates two micro-batches per step (the schedule counts optimizer steps)."""
    tmp_path = tmp_path_factory.mktemp("optim")
    return {"cosine": fit(tmp_path, kjv_data, "cosine", 1), "wsd": fit(tmp_path, kjv_data, "wsd", 2)}


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_each_step_applies_the_schedules_learning_rate(runs, schedule):
    record = runs[schedule]
    assert sorted(record.lrs) == list(range(STEPS))
    applied = [record.lrs[step] for step in range(STEPS)]
    for _ in range(EXTRA + 1):  # after the run: the rate the next steps of the same optimizer would apply
        applied.append([group["lr"] for group in record.optimizer.param_groups])
        record.scheduler.step()
    assert all(len(set(lrs)) == 1 and len(lrs) == 4 for lrs in applied), applied  # every group alike
    applied = [lrs[0] for lrs in applied]
    expected = [expected_lr(step, schedule) for step in range(STEPS + EXTRA + 1)]
    assert applied == pytest.approx(expected, rel=1e-9, abs=0), list(zip(applied, expected, strict=True))
    # The phases themselves, exactly where they fall: warmup from init_lr, the peak, the floor.
    peak, floor = OPTIM["lr"], OPTIM["lr"] * OPTIM["min_lr_ratio"]
    assert applied[0] == pytest.approx(OPTIM["init_lr"], rel=1e-9) and applied[0] < applied[1] < applied[2] < peak
    assert applied[3] == pytest.approx(peak, rel=1e-9)
    assert all(lr == pytest.approx(floor, rel=1e-9) for lr in applied[STEPS:])
    # WSD: the peak to step 9, where the last 3 steps' decay starts (9 -> 12: peak, 2 steps between, the floor).
    decaying = applied[10:STEPS] if schedule == "wsd" else applied[4:STEPS]
    assert all(floor < lr < peak for lr in decaying)
    assert all(a > b for a, b in zip(decaying, [*decaying[1:], floor], strict=True))
    if schedule == "wsd":
        assert applied[3:10] == pytest.approx([peak] * 7, rel=1e-9)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_each_parameter_gets_the_configured_weight_decay(runs, schedule):
    record = runs[schedule]
    model = record.module.model
    names = {id(p): name for name, p in model.named_parameters()}
    decays: dict[str, float] = {}
    for group in record.optimizer.param_groups:
        for p in group["params"]:
            assert names[id(p)] not in decays, names[id(p)]
            decays[names[id(p)]] = group["weight_decay"]
    assert sorted(decays) == sorted(names.values())  # every parameter, each in one group
    assert decays == {name: expected_decay(name) for name in decays}
    assert set(decays.values()) == {0.0, *(OPTIM[k] for k in ("weight_decay", "qk_weight_decay", "vo_weight_decay"))}
    assert "head.weight" in decays and "blocks.2.mixer.lam_raw" in decays and "blocks.0.mixer.a_param" in decays


def test_one_step_decays_each_parameter_by_its_configured_rate(runs):
    """By effect: a step of the module's freshly configured AdamW at lr 1 with zero gradients moves no parameter but
    by its decay, p -> p (1 - weight_decay) (Adam's update is 0 / (0 + eps) on fresh moments)."""
    module = runs["cosine"].module
    optimizer = module.configure_optimizers()["optimizer"]
    for group in optimizer.param_groups:
        group["lr"] = 1.0
    before = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    for p in module.model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in module.model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name] * (1 - expected_decay(name)), rtol=1e-6, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
        with torch.no_grad():
            p.copy_(before[name])

"""`lm compare ladder` run here: a tiny ladder of two architectures on the bundled corpus (one worker, in this process).
Its lr sweep, the lr its rule carries up (recomputed here from the runs' logged losses), the losses and compute the
fit takes (read back from each run's logs and config), the report joined to `lm compare report`, and a rerun that
trains nothing. The lr rule and its widening on numbers with a known answer; the planned GPU-hours against their
arithmetic; the data a plan reads against the corpus; bad ladder files end in one line, exit 2, with nothing written.
The same ladder as a SLURM array with a preempted task is in tests/test_slurm.py; the fits themselves are in
tests/test_scaling_fit.py, and the verdicts, on synthetic ladders, in tests/test_ladder_verdicts.py."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from lm.accounting.flops import train_flops_per_token
from lm.accounting.memory import largest_micro_batch
from lm.cli import main
from lm.compare.ladder import ladder
from lm.compare.lr_transfer import best_lr, fit_rule
from lm.model import LMConfig
from lm.util.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, BATCH = 32, 4
GRID = [3.0e-3, 1.0e-2]


def write_ladder(tmp: Path, data: str, **changes) -> Path:
    """A tiny ladder: 4 rungs of 100k-330k parameters at 0.02 tokens per parameter (16-52 steps of 4 x 32: what the
    tests read back from the runs does not need them to learn much)."""
    (tmp / "base.yaml").write_text(yaml.safe_dump({
        "seed": 0, "model": {"vocab_size": 512, "max_seq_len": SEQ_LEN},
        "data": {"path": data, "seq_len": SEQ_LEN, "micro_batch": BATCH, "global_batch": BATCH, "num_workers": 0,
                 "val_windows": 8},
        "optim": {"lr": 3.0e-3, "warmup_steps": 5},
        "trainer": {"val_every": 10**6, "ckpt_every": 10**6, "keep_last": 1, "log_every": 5, "progress_bar": False},
        "strategy": {"accelerator": "cpu", "devices": 1}}))
    spec = {"archs": ["attention", "hawk"], "rungs": [1.0e5, 1.5e5, 2.2e5, 3.3e5], "base": "base.yaml",
            "tokens_per_param": 0.02, "lr": {"grid": GRID, "sweep_rungs": 2, "against": "params", "slope": -1.0},
            "seeds": [1],
            "probes": [["ppl", "--max_windows", "2"]], "bootstrap": 100, **changes}
    path = tmp / "ladder.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def final_val_loss(run_dir: Path) -> float:
    """The last val/loss the run logged, read from its CSV log."""
    with open(next(run_dir.glob("logs/version_*/metrics.csv"))) as f:
        rows = [row for row in csv.DictReader(f) if row.get("val/loss")]
    return float(rows[-1]["val/loss"])


@pytest.fixture(scope="module")
def finished(kjv_data, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ladder")
    ladder(str(write_ladder(tmp, kjv_data)), out=str(tmp / "out"), workers=1)
    return tmp / "out"


def runs_of(out: Path, arch: str) -> dict[str, dict]:
    """Each run directory of `arch`: its config."""
    return {p.name: yaml.safe_load((p / "config.yaml").read_text()) for p in sorted((out / "runs").glob(f"{arch}-*"))}


@pytest.mark.parametrize("arch", ["attention", "hawk"])
def test_the_sweep_picks_the_best_grid_lr_and_the_rule_carries_it_up(finished, arch):
    runs = runs_of(finished, arch)
    params = {}
    best = {}
    for rung in ("100k", "150k"):
        swept = {lr: final_val_loss(finished / "runs" / f"{arch}-{rung}-lr{lr:.3g}-seed0") for lr in GRID}
        best[rung] = min(swept, key=swept.get)
        params[rung] = next(c for name, c in runs.items() if f"-{rung}-" in name)["model"]
    # lr = c / params (the file fixes the slope at -1), c the geometric mean of the two swept rungs' best lr x params,
    # evaluated at each larger rung's parameter count. (Two lrs put each best lr at an end of the grid.)
    from lm.accounting.flops import param_count

    sizes = [param_count(LMConfig(**params[r])) for r in ("100k", "150k")]
    log_c = np.mean(np.log([best["100k"], best["150k"]]) + np.log(sizes))
    for rung in ("220k", "330k"):
        (name, config), = [(n, c) for n, c in runs.items() if f"-{rung}-" in n]
        expected = float(f"{math.exp(log_c - math.log(param_count(LMConfig(**config['model'])))):.3g}")
        assert config["optim"]["lr"] == pytest.approx(expected, rel=1e-9), name
    assert len(runs) == 8  # 2 swept rungs x 2 lrs at the sweep's seed 0, then each rung at seed 1


def test_the_fit_takes_each_runs_final_loss_and_compute(finished):
    fits = json.loads((finished / "report" / "fits.json").read_text())
    for arch in ("attention", "hawk"):
        points = fits["points"][arch]
        assert len(points) == 4 and fits["fitted"][arch] == points  # one run per rung (seed 1, the swept ones at
        # their best lr), and at one tokens-per-parameter the L(C) fit takes them all
        assert {p["seed"] for p in points} == {1}  # the sweep's runs (seed 0) are not seeds
        for point in points:
            run_dir = finished / "runs" / point["run"]
            config = yaml.safe_load((run_dir / "config.yaml").read_text())
            steps = config["trainer"]["max_steps"]
            assert point["loss"] == pytest.approx(final_val_loss(run_dir), rel=1e-12)
            assert point["compute"] == pytest.approx(
                train_flops_per_token(LMConfig(**config["model"]), SEQ_LEN) * steps * BATCH * SEQ_LEN, rel=1e-12)
            assert (run_dir / "checkpoints" / f"step={steps:08d}.ckpt").is_file()
            assert (run_dir / "eval" / "ppl-ladder0" / "per_position.csv").is_file()  # the probe ran
        fit = fits["fits"][arch]
        low, high = fit["alpha_interval"]
        assert low - 1e-9 <= fit["alpha"] <= high + 1e-9  # to rounding: here the estimate sits at the interval's end


def test_the_report_joins_lm_compare_report(finished):
    report = finished / "report"
    assert (report / "ladder.png").stat().st_size > 10_000
    ladder_md = (report / "ladder.md").read_text()
    assert "| attention | 4 |" in ladder_md and "| hawk | 4 |" in ladder_md
    assert "attention / hawk" in ladder_md  # the crossover row
    compare_md = (report / "compare" / "report.md").read_text()
    assert "## Scaling ladder: L(C) per architecture" in compare_md and "| attention | 4 |" in compare_md
    assert "Scaling ladder" in (report / "compare" / "report.html").read_text()


def test_a_rerun_trains_nothing(finished, capsys):
    checkpoints = {p: p.stat().st_mtime_ns for p in finished.glob("runs/*/checkpoints/*.ckpt")}
    ladder(str(finished.parent / "ladder.yaml"), out=str(finished), workers=1)
    assert "runs to train" not in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in finished.glob("runs/*/checkpoints/*.ckpt")} == checkpoints


def test_best_lr_is_the_vertex_of_the_parabola_in_log_lr():
    losses = {lr: 3.0 + (math.log(lr) - math.log(4e-3)) ** 2 for lr in (1e-3, 2e-3, 8e-3, 1.6e-2)}
    lr, how = best_lr(losses)
    assert lr == pytest.approx(4e-3, rel=1e-9) and how == "parabola vertex"
    assert best_lr({1e-3: 3.0, 2e-3: 3.1, 4e-3: 3.5}) == (1e-3, "grid edge")
    assert best_lr({1e-3: 3.0, 2e-3: math.nan, 4e-3: 2.5}) == (4e-3, "grid minimum")
    # The next lr diverged: the largest stable one is the best, bracketed; at the grid's own top it is an edge.
    assert best_lr({1e-3: 3.5, 2e-3: 3.2, 4e-3: 3.0, 8e-3: math.inf}) == (4e-3, "below a diverged lr")
    assert best_lr({1e-3: 3.5, 2e-3: 3.2, 4e-3: 3.0}) == (4e-3, "grid edge")


def test_a_sweep_widens_beyond_the_end_where_its_best_lies():
    """A best lr at an end of the lrs tried asks for the next one beyond it, by the step between the two lrs at that
    end; a best between two others, or just below an lr that diverged, asks for none; nor does an end already widened
    `widen` times beyond the first lrs."""
    from lm.compare.lr_transfer import widening

    first = [1e-3, 2e-3, 4e-3]
    assert widening({1e-3: 3.0, 2e-3: 3.1, 4e-3: 3.3}, first, 3) == 5e-4
    assert widening({1e-3: 3.3, 2e-3: 3.1, 4e-3: 3.0}, first, 3) == 8e-3
    assert widening({1e-3: 3.3, 2e-3: 3.0, 4e-3: 3.1}, first, 3) is None
    assert widening({1e-3: 3.3, 2e-3: 3.1, 4e-3: 3.0, 8e-3: math.inf}, first, 3) is None
    assert widening({5e-4: 2.9, 1e-3: 3.0, 2e-3: 3.1, 4e-3: 3.3}, first, 1) is None
    assert widening({5e-4: 2.9, 1e-3: 3.0, 2e-3: 3.1, 4e-3: 3.3}, first, 2) == 2.5e-4


def test_a_plan_says_the_epochs_each_run_reads_and_what_the_target_needs(kjv_data, tmp_path, capsys):
    """A run that would read more tokens than the corpus holds is refused (BAD); with repeat_data it is planned, and
    the plan shows its epochs: its tokens over the corpus's training windows of seq_len; and the target's tokens at
    the ladder's tokens per parameter against the corpus."""
    from lm.data_prep.shards import load_manifest

    path = write_ladder(tmp_path, kjv_data, tokens_per_param=20, repeat_data=True, target_compute=1e13)
    ladder(str(path), dry_run=True)
    out = capsys.readouterr().out
    corpus = (load_manifest(kjv_data, verify=False)["splits"]["train"]["tokens"] - 1) // SEQ_LEN * SEQ_LEN
    row = next(line.split(" | ") for line in out.splitlines() if line.startswith("| attention | 330k |"))
    tokens = round(20 * 3.3e5 / (BATCH * SEQ_LEN)) * BATCH * SEQ_LEN  # the steps 20 tokens per parameter buy
    assert float(row[-1].rstrip(" |")) == pytest.approx(tokens / corpus, rel=1e-3) and tokens > corpus
    assert "repeat_data is set, so a run may read it more than once" in out
    assert "The target, 1.000e13 FLOPs at 20 tokens per parameter, needs about" in out
    assert not (tmp_path / "out").exists()


def test_the_last_step_is_validated():
    from lm.compare.ladder_plan import aligned_steps

    assert aligned_steps(5570, 1000) == (5570, 1114)  # 5 validations, the last at the last step
    assert aligned_steps(5569, 1000) == (5565, 1113)
    assert aligned_steps(439, 10**6) == (439, 439)  # one, at the end
    assert aligned_steps(7, 2) == (6, 2)


def test_the_rule_recovers_a_power_law():
    points = [(size, 0.5 * size ** -0.7) for size in (64, 96, 128)]
    rule = fit_rule(points, "width", None)
    assert rule.slope == pytest.approx(-0.7) and rule.lr(512) == pytest.approx(0.5 * 512 ** -0.7)
    assert rule.slope_se == pytest.approx(0.0, abs=1e-9)
    # Off the line by a factor exp(+-0.1) at the ends and exp(-+0.2) inside: the slope's standard error is that of
    # least squares, sqrt(residual variance / sum of (x - mean)^2).
    x = np.log([64, 96, 128, 192])
    bumped = [(s, 0.5 * s ** -0.7 * math.exp(e)) for s, e in zip((64, 96, 128, 192), (0.1, -0.2, 0.2, -0.1))]
    slope, intercept = np.polyfit(x, np.log([lr for _, lr in bumped]), 1)
    residual = np.log([lr for _, lr in bumped]) - intercept - slope * x
    se = math.sqrt(np.sum(residual ** 2) / 2 / np.sum((x - x.mean()) ** 2))
    assert fit_rule(bumped, "width", None).slope_se == pytest.approx(se, rel=1e-9)
    fixed = fit_rule(points[:1], "width", -1.0)
    assert fixed.slope == -1.0 and fixed.lr(64) == pytest.approx(points[0][1])
    with pytest.raises(UserError, match="needs swept rungs of two sizes"):
        fit_rule([(64, 1e-3), (64, 2e-3)], "width", None)


def test_planned_gpu_hours_follow_mfu_peak_and_the_memory_plan(kjv_data, tmp_path, capsys):
    from lm.compare.ladder_config import load_ladder
    from lm.compare.ladder_plan import plan_rungs
    from lm.compare.plan import load_base

    gpu = {"peak_flops": 1.0e5, "gpu_gib": 0.05, "mfu": {"attention": 0.4}, "default_mfu": 0.1}
    path = write_ladder(tmp_path, kjv_data, archs=["attention", "hawk_mesa"], rungs=[1.0e5, 2.2e5], seeds=[1, 2],
                        lr={"grid": GRID, "sweep_rungs": 1, "slope": -1.0}, gpu=gpu)
    ladder(str(path), dry_run=True)
    out = capsys.readouterr().out
    rows = {(r[0].strip("| "), r[1]): r for r in (line.split(" | ") for line in out.splitlines())
            if len(r) == 8 and r[4].endswith("%")}
    spec = load_ladder(str(path))
    rungs = plan_rungs(spec, load_base(spec.base)[1], BATCH)
    for arch, mfu in (("attention", 0.4), ("hawk_mesa", 0.1)):  # a hybrid: its slowest mixer's (both default)
        total = 0.0
        for rung in rungs[arch]:
            row = rows[arch, rung.label]
            tokens_per_s = mfu * 1e5 / train_flops_per_token(LMConfig(**rung.model), SEQ_LEN)
            runs = 2 + (len(GRID) if rung.label == "100k" else 0)  # 2 seeds, and the sweep's lrs at the swept rung
            assert float(row[5].replace(",", "")) == pytest.approx(tokens_per_s, abs=0.5)
            assert float(row[6].replace(",", "")) == pytest.approx(rung.tokens / tokens_per_s / 3600, abs=0.05)
            assert row[7] == f"{runs} -> {runs * rung.tokens / tokens_per_s / 3600:,.0f} |"
            total += runs * rung.tokens / tokens_per_s / 3600
            model = LMConfig(**rung.model)
            fits = largest_micro_batch(model, SEQ_LEN, 0.05 * 2**30)
            assert int(row[2]) == rung.micro_batch == 1 << (min(fits, BATCH).bit_length() - 1)
        assert f"{arch} {total:,.0f}" in out
    assert not (tmp_path / "out").exists() and not Path("runs/ladder").exists()


def test_the_micro_batch_is_the_largest_power_of_two_that_fits(kjv_data, tmp_path):
    from lm.compare.ladder_config import load_ladder
    from lm.compare.ladder_plan import memory_fit

    spec = load_ladder(str(write_ladder(tmp_path, kjv_data, gpu={"gpu_gib": 0.05})))
    cfg = LMConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, head_dim=16, max_seq_len=SEQ_LEN)
    fits = largest_micro_batch(cfg, SEQ_LEN, 0.05 * 2**30)
    micro, checkpointing = memory_fit(spec, cfg, SEQ_LEN, 64, "x")
    assert not checkpointing and micro == 1 << (min(fits, 64).bit_length() - 1)
    with pytest.raises(UserError, match="does not fit one GPU"):
        memory_fit(load_ladder(str(write_ladder(tmp_path, kjv_data, gpu={"gpu_gib": 1e-6}))), cfg, SEQ_LEN, 64, "x")


BAD = {
    "an unknown key": ({"rugns": [1]}, "unknown key(s) rugns in the ladder file"),
    "a missing base": ({"base": "nowhere.yaml"}, "base config"),
    "a rung that is no number": ({"rungs": ["big"]}, "rungs must be a number"),
    "an lr rule against nothing": ({"lr": {"grid": GRID, "against": "depth"}}, "lr.against must be width or params"),
    "one swept rung and no slope": ({"lr": {"grid": GRID, "sweep_rungs": 1}}, "one swept rung cannot fit"),
    "swept rungs of one width": ({"rungs": [1.2e5, 1.5e5, 2.2e5], "lr": {"grid": GRID, "sweep_rungs": 2,
                                                                     "against": "width"}},
                                 "swept rungs share one d_model (64)"),
    "a probe that is no command": ({"probes": [["perplexity"]]}, "probe 'perplexity' is no lm eval command"),
    "a probe option it lacks": ({"probes": [["ppl", "--windows", "2"]]}, "probe ppl --windows 2"),
    "a vocabulary the base lacks": ({"prepare": {"vocab_size": 1024}}, "prepare.vocab_size 1024 differs"),
    "an unknown architecture": ({"archs": ["attention", "transformer"]}, "unknown architecture 'transformer'"),
    "both an lr grid and a start": ({"lr": {"grid": GRID, "start": 1e-3}}, "lr needs either start"),
    "two lr factors": ({"lr": {"start": 1e-3, "factors": [1, 2]}}, "lr.factors needs at least 3"),
    "a start for an arch not in archs": ({"lr": {"start": {"attention": 1e-3, "mamba2": 1e-3}}},
                                         "lr.start must give one lr for each architecture of archs: mamba2 not in "
                                         "archs; none for hawk"),
    "a chosen value and no choice": ({"archs": ["mesa@cg_steps=chosen"]}, "takes a value chosen by measurement"),
    "a choice no arch takes": ({"choose": {"arch": "mesa", "option": "cg_steps", "values": [2, 30], "reference": 30,
                                           "rung": 1e5, "lr": 1e-2, "seeds": [0, 1], "tolerance": 0.02}},
                               "no architecture takes it"),
    "a choice of an option the arch lacks": ({"archs": ["mesa@cg_steps=chosen"], "choose": {
        "arch": "mesa", "option": "cg_step", "values": [2, 30], "reference": 30, "rung": 1e5, "lr": 1e-2,
        "seeds": [0, 1], "tolerance": 0.02}}, "choose: architecture 'mesa@cg_step=2': 'cg_step=2' is not OPTION=VALUE"),
    "a choice from one seed": ({"archs": ["mesa@cg_steps=chosen"], "choose": {
        "arch": "mesa", "option": "cg_steps", "values": [2, 30], "reference": 30, "rung": 1e5, "lr": 1e-2,
        "tolerance": 0.02}}, "choose.seeds must list at least 2"),
    "a choice without its tolerance": ({"archs": ["mesa@cg_steps=chosen"], "choose": {
        "arch": "mesa", "option": "cg_steps", "values": [2, 30], "reference": 30, "rung": 1e5, "lr": 1e-2,
        "seeds": [0, 1]}}, "choose needs tolerance"),
    "the sweep's seed among the seeds": ({"seeds": [0, 1]}, "seeds include the sweep's seed 0"),
    "a data seed that is no number": ({"data_seed": "first"}, "sweep_seed and data_seed must be whole numbers"),
    "a run that reads the corpus twice": ({"tokens_per_param": 20}, "epochs of the corpus's"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_ladder_file_is_one_line_and_writes_nothing(kjv_data, tmp_path, capsys, case):
    changes, message = BAD[case]
    path = write_ladder(tmp_path, kjv_data, **changes)
    assert main(["compare", "ladder", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_the_command_line_says_a_missing_ladder_file_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lm.cli", "compare", "ladder", str(tmp_path / "none.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"lm compare ladder: error: ladder file {tmp_path / 'none.yaml'} not found"


def test_the_shipped_ladders_load():
    from lm.compare.ladder_config import load_ladder

    for path in sorted((ROOT / "configs" / "ladder").glob("*.yaml")):
        if not path.name.endswith("_base.yaml"):
            assert load_ladder(str(path)).archs, path


def optimal_size(budget: float, a=400.0, alpha=0.34, b=410.0, beta=0.28) -> float:
    """The N that minimises E + A N^-alpha + B (C / 6N)^-beta at C = budget (its derivative in N set to zero)."""
    return ((alpha * a) / (beta * b * (budget / 6) ** -beta)) ** (1 / (alpha + beta))


def chinchilla_rows(budgets, e=1.7, a=400.0, alpha=0.34, b=410.0, beta=0.28) -> list[dict]:
    """At each budget (C = 6 N D), 9 sizes from a tenth to ten times the optimal one, with losses from
    L(N, D) = E + A N^-alpha + B D^-beta."""
    rows = []
    for budget in budgets:
        for n in optimal_size(budget) * np.geomspace(0.1, 10, 9):
            d = budget / (6 * n)
            rows.append({"budget": budget, "params": n, "tokens": d, "compute": budget, "rung": f"{n:g}",
                         "loss": e + a * n ** -alpha + b * d ** -beta})
    return rows


def test_iso_flop_parabolas_find_the_compute_optimal_size_and_l_nd_recovers_its_law():
    from lm.compare.ladder_config import LrSweep
    from lm.compare.ladder_report import isoflop, nd_fit

    rows = chinchilla_rows([1e16, 1e17, 1e18])
    parabolas, best = isoflop(rows)
    for p in parabolas:  # a parabola in log N only approximates the curve: its vertex within 10%
        assert abs(math.log(p["params_opt"] / optimal_size(p["budget"]))) < 0.1, p
    assert {r["budget"] for r in best} == {1e16, 1e17, 1e18}
    for budget in (1e16, 1e17, 1e18):
        at = [r for r in rows if r["budget"] == budget]
        assert [r for r in best if r["budget"] == budget] == [min(at, key=lambda r: r["loss"])]
    spec = type("Spec", (), {"level": 0.9, "bootstrap": 50, "lr": LrSweep((1e-3,))})()
    fit = nd_fit(rows, spec)
    assert fit["alpha"] == pytest.approx(0.34, rel=1e-4) and fit["beta"] == pytest.approx(0.28, rel=1e-4)
    assert fit["E"] == pytest.approx(1.7, rel=1e-4)
    one_line = [dict(r, tokens=20 * r["params"]) for r in rows]  # D = 20 N: N and D cannot be told apart
    assert nd_fit(one_line, spec) is None


def test_an_iso_flop_ladder_trains_every_size_at_every_budget(kjv_data, tmp_path):
    path = write_ladder(tmp_path, kjv_data, archs=["attention"], rungs=[1.0e5, 1.5e5, 2.2e5], budgets=[1.5e9, 3.0e9],
                        lr={"grid": [3.0e-3], "sweep_rungs": 1, "slope": 0.0}, probes=[])
    ladder(str(path), out=str(tmp_path / "out"), workers=1)
    trained = runs_of(tmp_path / "out", "attention")
    runs = {name: config for name, config in trained.items() if name.endswith("-seed1")}
    assert len(runs) == 6  # every size at every budget, at the ladder's seed; and the grid's one run at seed 0
    assert sorted(set(trained) - set(runs)) == ["attention-100k-C1.500e9-lr0.003-seed0"]
    for name, config in trained.items():
        budget = float(name.split("-C")[1].split("-lr")[0])
        per_token = train_flops_per_token(LMConfig(**config["model"]), SEQ_LEN)
        steps = config["trainer"]["max_steps"]
        assert abs(steps - budget / per_token / (BATCH * SEQ_LEN)) <= 1, name  # the budget buys the steps
    fits = json.loads((tmp_path / "out" / "report" / "fits.json").read_text())
    for budget in (1.5e9, 3.0e9):
        at = {n: final_val_loss(tmp_path / "out" / "runs" / n) for n in runs if f"-C{budget:.3e}".replace("e+0", "e")
              in n}
        assert len(at) == 3
        (point,) = [p for p in fits["fitted"]["attention"] if p["budget"] == budget]
        assert point["run"] == min(at, key=at.get)  # L(C) takes each budget's best size
    assert len(fits["parabolas"]["attention"]) == 2
    assert (tmp_path / "out" / "report" / "isoflop.png").is_file()
    report = (tmp_path / "out" / "report" / "ladder.md").read_text()
    assert "## Compute-optimal comparison (iso-FLOP parabolas)" in report


def test_a_run_that_diverges_ends_as_diverged_with_an_infinite_loss(kjv_data, tmp_path, monkeypatch):
    """A high lr of the sweep may diverge: `lm train` stops with Diverged, and the ladder marks the run as ended
    (a rerun does not train it again) with an infinite final loss, rather than failing the whole ladder."""
    from lm.compare.ladder import DIVERGED, final_loss, train_run

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "seed": 0,
        "model": {"vocab_size": 512, "d_model": 32, "n_layers": 1, "n_heads": 2, "head_dim": 16, "max_seq_len": 32},
        "data": {"path": kjv_data, "seq_len": 32, "micro_batch": 4, "num_workers": 0, "val_windows": 2},
        "optim": {"warmup_steps": 1},
        "trainer": {"max_steps": 10, "val_every": 10, "ckpt_every": 10, "stop_after_skips": 2,
                    "progress_bar": False}}))
    monkeypatch.setenv("LM_FAULTS", "nan_grad@2,nan_grad@3")
    train_run(str(config))
    assert "were not finite" in (tmp_path / "run" / DIVERGED).read_text()
    assert final_loss(tmp_path / "run") == math.inf


def test_a_stage_in_worker_processes_says_where_each_run_stands(tmp_path, monkeypatch, capsys):
    """Every few seconds while a stage trains in workers: the runs ended, and each started run's newest step with its
    eta, read from its log; a run with no log yet is not named."""
    import time

    from lm.compare import ladder_progress

    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "c", "d")}
    logs["a"].write_text("lm train: 1 processes x ...\nstep 10/100 | loss 3.2 | tokens/s 5 | elapsed 0:00:10 | eta "
                         "0:01:30\nstep 20/100 | loss 3.0 | tokens/s 5 | elapsed 0:00:20 | eta 0:01:20\n")
    logs["b"].write_text("lm train: 1 processes x ...\n")
    logs["d"].write_text("step 100/100 | val loss 2.9 | val ppl 18.2\n")
    ended = lambda name: name == "d"  # noqa: E731
    expected = ("lm compare ladder: rungs: 1 of 4 runs ended; a at step 20/100 (eta 0:01:20); b starting")
    assert ladder_progress.line("rungs", logs, ended) == expected
    assert ladder_progress.line("rungs", {"c": logs["c"]}, ended) is None  # nothing to say yet
    monkeypatch.setattr(ladder_progress, "EVERY", 0.05)
    with ladder_progress.StageProgress("rungs", logs, ended):
        time.sleep(0.3)
    assert expected in capsys.readouterr().err.splitlines()

"""`lm train` under data x context parallelism (DDP on 4 gloo processes: 2 replicas x 2 ranks sharing each window,
micro_batch 1 < N = 2, in float64) against the same run on one process (accumulating): the same loss and gradient
norm at every step, the same weights, validation loss and FLOPs, and throughput figures that count a shared window
once; a stop notice checkpoints, and the run resumes exactly on its own layout or on another (one process). Two nodes
of one process each, started by hand, log the one-process loss at every step too (plain DDP on 2 processes launched by
Lightning is compared with one process in tests/test_scale_out.py)."""

import csv
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from strategy_runs import environment, lm_command, train, train_here
from test_scale_out import exported, last_launch_losses

from lm.accounting.flops import forward_flops_per_token
from lm.cli import main
from lm.compare.run_results import read_run
from lm.training.checkpoint import step_checkpoints
from lm.training.config import parse_run_config
from lm.training.stop_request import STOPPED_EXIT_CODE

PIECES, REPLICAS, SEQ_LEN, PEAK = 2, 2, 32, 1.0e9
WORLD = PIECES * REPLICAS
DATA_X_CONTEXT = ["--strategy.name", "ddp", "--strategy.devices", str(WORLD), "--strategy.context_parallel",
                  str(PIECES)]
TWO_NODES = ["--strategy.name", "ddp", "--strategy.num_nodes", "2", "--strategy.devices", "1"]


def config(tmp: Path, data: str) -> Path:
    # A hybrid: a recurrence whose state crosses the ranks (Gated DeltaNet, with its convolutions) and attention
    # (its keys and values, and their rotary positions). A global batch of 2 windows: one process accumulates 2
    # micro-batches of 1; 2 x 2 processes give each context group one window per step, each rank half of it.
    path = tmp / "cp.yaml"
    path.write_text(f"""
seed: 5
model: {{vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 2, head_dim: 16, max_seq_len: {SEQ_LEN},
         layer_pattern: "gated_deltanet,attention", mixer_options: {{gated_deltanet: {{chunk_size: 8}}}}}}
data: {{path: {data}, seq_len: {SEQ_LEN}, micro_batch: 1, global_batch: 2, num_workers: 0, val_windows: 4}}
optim: {{lr: 1.0e-2, warmup_steps: 1}}
trainer: {{max_steps: 4, val_every: 2, ckpt_every: 2, keep_last: 3, log_every: 1, progress_bar: false,
          peak_flops: {PEAK}}}
strategy: {{accelerator: cpu, precision: 64-true}}
""")
    return path


def rows(run_dir: Path) -> list[list[dict]]:
    """Each launch's metrics.csv rows, oldest launch first."""
    launches = sorted(run_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    result = []
    for path in launches:
        with open(path) as f:
            result.append(list(csv.DictReader(f)))
    return result


def logged(run_dir: Path, key: str) -> dict[int, float]:
    """step -> the value of `key` logged at it (a later launch's over an earlier one's)."""
    return {int(r["step"]): float(r[key]) for launch in rows(run_dir) for r in launch if r.get(key)}


@pytest.fixture(scope="module")
def runs(kjv_data, tmp_path_factory, one_thread) -> dict:
    """The run on one process; on 2 x 2 processes, stopped by a notice during step 2 (it checkpoints at the step's
    end), then resumed to the end on 2 x 2, and (a copy) in one process; on 2 DDP processes started by hand as two
    nodes. Two launches at a time; the one-process runs in this process."""
    tmp = tmp_path_factory.mktemp("context_parallel")
    cfg = config(tmp, kjv_data)

    def stopped_then_resumed():
        stopped = subprocess.run(lm_command("train", "--config", str(cfg), "--run_dir", str(tmp / "cp"),
                                            *DATA_X_CONTEXT),
                                 env={**environment(), "LM_FAULTS": "signal@step:1"}, capture_output=True, text=True,
                                 timeout=600)
        checkpoints = [p.name for p in step_checkpoints(tmp / "cp" / "checkpoints")]
        shutil.copytree(tmp / "cp", tmp / "cp-then-one")
        return stopped, checkpoints

    def nodes_by_hand() -> list[subprocess.CompletedProcess]:
        """Two nodes started by hand, as lm's refusal of strategy.num_nodes without a launcher says (here both on
        this machine): each `lm train` with MASTER_ADDR, MASTER_PORT and its NODE_RANK."""
        env = {**environment(), "MASTER_ADDR": "127.0.0.1"}
        nodes = [subprocess.Popen(lm_command("train", "--config", str(cfg), "--run_dir", str(tmp / "nodes"),
                                             *TWO_NODES), env={**env, "NODE_RANK": str(rank)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        ended = [(node, *node.communicate(timeout=600)) for node in nodes]
        return [subprocess.CompletedProcess(node.args, node.returncode, out, err) for node, out, err in ended]

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(stopped_then_resumed)
        single = train_here(cfg, tmp / "single")
        assert single.returncode == 0, single.stderr[-3000:]
        nodes = nodes_by_hand()
        stopped, checkpoints = first.result()
        resumed = pool.submit(train, cfg, tmp / "cp", *DATA_X_CONTEXT)
        one = train_here(cfg, tmp / "cp-then-one")
        assert one.returncode == 0, one.stderr[-3000:]
        resumed = resumed.result()
    return {"config": cfg, "single": tmp / "single", "cp": tmp / "cp", "cp-then-one": tmp / "cp-then-one",
            "nodes": tmp / "nodes", "nodes_launches": nodes, "stopped": stopped,
            "checkpoints": checkpoints, "resumed": resumed}


def test_data_x_context_parallel_training_is_one_process_step_for_step(runs, tmp_path):
    assert f"lm train: {REPLICAS} processes (context parallel: {PIECES} processes share each window)" in \
        runs["resumed"].stderr
    for key in ("train/loss", "train/grad_norm"):
        single, cp = logged(runs["single"], key), logged(runs["cp"], key)
        assert sorted(cp) == [1, 2, 3, 4]
        assert [cp[s] for s in sorted(cp)] == pytest.approx([single[s] for s in sorted(cp)], rel=1e-10, abs=0), key
    a, b = exported(runs["single"], tmp_path / "a"), exported(runs["cp"], tmp_path / "b")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-10) for k in a)
    # Validation: each group scores its replica's windows by pieces; the mean is one process's loss. (The stop
    # skips step 2's.)
    single, cp = read_run(str(runs["single"])), read_run(str(runs["cp"]))
    assert cp.val_curve[-1][0] == 4
    assert [v for _, v in cp.val_curve] == pytest.approx([dict(single.val_curve)[s] for s, _ in cp.val_curve],
                                                         rel=1e-10)
    # The compute charged: each group spends its windows' FLOPs once, between its ranks.
    assert cp.spent[0] == 4 and cp.spent[1] == pytest.approx(single.spent[1], rel=1e-12)


def test_one_and_two_processes_log_the_same_loss_and_gradient_norm_at_every_step(runs):
    """One process accumulating 2 micro-batches and 2 DDP processes with one each (the two nodes started by hand):
    train/loss (and train/ppl) is the step's mean over both, and train/grad_norm the norm of the step's whole
    gradient."""
    for node in runs["nodes_launches"]:
        assert node.returncode == 0, node.stderr[-2000:]
    for key in ("train/loss", "train/ppl", "train/grad_norm"):
        single, ddp = logged(runs["single"], key), logged(runs["nodes"], key)
        assert sorted(ddp) == sorted(single) == [1, 2, 3, 4]
        assert [ddp[s] for s in sorted(ddp)] == pytest.approx([single[s] for s in sorted(ddp)], rel=1e-10, abs=0), key


def test_nodes_started_by_hand_train_as_one_run(runs):
    """Two `lm train` processes started by hand as two nodes of one process each (MASTER_ADDR, MASTER_PORT and
    NODE_RANK; tests/test_train.py has those that cannot meet refused) train as one 2-process DDP run: both meet,
    rank 0 logs every step's loss and gradient norm of both (those of one process, above), and checkpoints."""
    for node in runs["nodes_launches"]:
        assert node.returncode == 0, node.stderr[-2000:]
    assert "lm train: 2 processes x micro_batch 1 x accumulate 1" in runs["nodes_launches"][0].stderr
    for key in ("train/loss", "train/grad_norm"):
        assert sorted(logged(runs["nodes"], key)) == [1, 2, 3, 4]
    assert (runs["nodes"] / "checkpoints" / "step=00000004.ckpt").is_file()


def test_throughput_counts_a_window_shared_by_its_ranks_once(runs):
    """micro_batch 1 < N 2. Over each rate's window (its last 2 micro-batches: the time between two logged rows, as
    the run's log_every 1 and accumulation 1 make it), the rates make the counts of a step: 2 windows (one per
    group), 64 tokens, the FLOPs one process logs for the step; per device, those over 4 processes; MFU against
    the configured peak. Validation (a window per group per micro-batch): the forward's FLOPs."""
    steps_flops = logged(runs["single"], "train/flops")
    cfg = parse_run_config(["--config", str(runs["config"])])[0].model
    checked = {"train": 0, "validate": 0}
    for launch in rows(runs["cp"]):
        for stage in checked:
            timed = [r for r in launch if r.get(f"{stage}/time")]
            for before, row in zip(timed, timed[1:], strict=False):
                if not row.get(f"{stage}/samples_per_sec") or (stage == "validate" and row["step"] != before["step"]):
                    continue  # a rate needs 2 updates of one launch (a validation's: of one validation)
                dt = float(row[f"{stage}/time"]) - float(before[f"{stage}/time"])
                step = int(row["step"])
                flops = (steps_flops[step] - steps_flops[step - 1] if stage == "train" else
                         forward_flops_per_token(cfg, SEQ_LEN) * SEQ_LEN * REPLICAS)
                expected = {"batches": REPLICAS, "samples": REPLICAS, "items": REPLICAS * SEQ_LEN, "flops": flops}
                for name, count in expected.items():
                    rate = float(row[f"{stage}/{name}_per_sec"])
                    assert rate * dt == pytest.approx(count, rel=1e-9), (stage, name, step)
                    assert float(row[f"{stage}/device/{name}_per_sec"]) == pytest.approx(rate / WORLD, rel=1e-12)
                assert float(row[f"{stage}/device/mfu"]) == pytest.approx(
                    float(row[f"{stage}/device/flops_per_sec"]) / PEAK, rel=1e-12)
                checked[stage] += 1
    assert checked["train"] == 2 and checked["validate"] >= 1  # steps 2 and 4 (each launch's second); a validation


def test_a_stop_notice_checkpoints_and_the_run_resumes_exactly_on_its_layout_or_another(runs):
    assert runs["stopped"].returncode == STOPPED_EXIT_CODE, runs["stopped"].stderr[-2000:]
    assert runs["checkpoints"] == ["step=00000002.ckpt"]
    assert "resuming from" in runs["resumed"].stderr
    single = logged(runs["single"], "train/loss")
    for resumed in (runs["cp"], runs["cp-then-one"]):
        after = last_launch_losses(resumed)
        assert sorted(after) == [3, 4] and [after[3], after[4]] == pytest.approx([single[3], single[4]], rel=1e-10)


def test_a_context_parallel_size_that_does_not_divide_is_one_line(kjv_data, tmp_path, capsys):
    code = main(["train", "--config", str(config(tmp_path, kjv_data)), "--run_dir", str(tmp_path / "run"),
                 "--strategy.name", "ddp", "--strategy.devices", "2", "--strategy.context_parallel", "4"])
    assert code == 2
    assert "strategy.context_parallel 4 does not divide the 2 processes" in capsys.readouterr().err

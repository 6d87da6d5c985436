"""`lm slurm` against a real two-node SLURM cluster (slurm/local_cluster.sh, which .ci/run starts; each node a network
namespace with its own address and hostname): a 2-task CPU training job on one node; the same run as DDP on 2 nodes x
1 process, preempted with SIGUSR1 (checkpoint, requeue, resume, the one-node run's weights bit for bit); ZeRO-2 and
FSDP2 on 2 nodes against the same runs on one machine; a 2-node checkpoint resumed on one node; an array of two runs,
an evaluation job, the launch guards, `lm compare ladder` as array jobs with a preempted task, and `lm prepare` as an
array with a merge. The rendered script for 4 nodes x 8 GPUs is checked line by line without a cluster."""

import contextlib
import csv
import fcntl
import io
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest
import torch
import yaml
from strategy_runs import STRATEGIES as LOCAL_STRATEGIES

from lm.cli import main
from lm.slurm.submit import submit_from_args, sweep_runs
from lm.training.checkpoint import newest_checkpoint
from lm.training.launch_guard import LOCK_NAME
from lm.training.stop_request import STOPPED_EXIT_CODE
from lm.util.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "slurm" / "local_cluster.sh"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
STEPS = 100  # the stop lands a few steps after the first checkpoint (20), far from the last ones (80, 100)


@pytest.fixture(scope="module")
def cluster():
    """The local cluster's environment. In CI it must be up (.ci/run starts it); elsewhere the tests skip."""
    conf = os.environ.get("SLURM_CONF") or str(Path(os.environ.get("LM_SLURM_DIR", "/tmp/lm-slurm")) / "slurm.conf")
    env = {**os.environ, "SLURM_CONF": conf, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    up = subprocess.run(["bash", str(CLUSTER), "status"], env=env, capture_output=True).returncode == 0
    if not up:
        if os.environ.get("CI"):
            pytest.fail("the local SLURM cluster is not running: .ci/run starts it with slurm/local_cluster.sh start")
        pytest.skip("no local SLURM cluster: start it with slurm/local_cluster.sh start")
    return env


def config_file(tmp: Path, data: str, devices: int = 2, nodes: int = 1, **trainer) -> Path:
    """A run of the global batch 4 on nodes x devices processes: DDP, or the single strategy for one process."""
    settings = {"max_steps": STEPS, "val_every": 1000, "ckpt_every": 20, "keep_last": 2, "log_every": 1,
                "progress_bar": "false", **trainer}
    world = devices * nodes
    path = tmp / f"run-{nodes}x{devices}.yaml"
    path.write_text(f"""
seed: 3
model: {{vocab_size: 512, d_model: 64, n_layers: 2, n_heads: 2, head_dim: 32, max_seq_len: 64}}
data: {{path: {data}, seq_len: 64, micro_batch: {4 // world}, global_batch: 4, num_workers: 0, val_windows: 8}}
optim: {{lr: 3.0e-3, warmup_steps: 2}}
trainer: {{{", ".join(f"{k}: {v}" for k, v in settings.items())}}}
strategy: {{accelerator: cpu, name: {"ddp" if world > 1 else "single"}, devices: {devices}, num_nodes: {nodes}}}
""")
    return path


def lm(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "lm.cli", *args], env=env, capture_output=True, text=True,
                            timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"lm {' '.join(args)} -> {result.returncode}\n{result.stderr[-3000:]}")
    return result


def lm_here(env: dict, *args: str) -> str:
    """`lm ARGS` in this process, in the environment `env` (which sbatch passes on to the job); its stdout. A fresh
    process would import torch and Lightning again: seconds per call, for commands that take a fraction of one."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        for key, value in env.items():
            if os.environ.get(key) != value:
                patch.setenv(key, value)
        code = main(list(args))
    assert code == 0, f"lm {' '.join(args)} -> {code}"
    return out.getvalue()


def submit(env: dict, *args: str) -> str:
    return lm_here(env, "slurm", "submit", *args).strip().splitlines()[-1]


def job_info(env: dict, job: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_until_ended(env: dict, job: str, timeout: float = 240) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job_info(env, job)
        if info.get("JobState") in ENDED:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} did not end within {timeout} s: {info}")


def wait_for_a_checkpoint(env: dict, job: str, run_dir: Path, timeout: float = 180) -> None:
    """Until the running job has written its first checkpoint. A job that ended first, or that still waits in the
    queue at the deadline (a stray job holding a node), fails with its state, reason and the tail of its stderr."""
    deadline = time.time() + timeout
    while newest_checkpoint(run_dir / "checkpoints", warn=False) is None:
        info = job_info(env, job)
        if info.get("JobState") in ENDED or time.time() > deadline:
            err = run_dir / "slurm" / f"job-{job}.err"
            queue = subprocess.run(["squeue", "-h", "-o", "%A %j %T %R"], env=env, capture_output=True,
                                   text=True).stdout
            raise AssertionError(f"no checkpoint in {run_dir}: job {job} {info.get('JobState')} "
                                 f"({info.get('Reason')}) after {timeout - deadline + time.time():.0f} s; queue:\n"
                                 f"{queue}{err.read_text()[-3000:] if err.is_file() else ''}")
        time.sleep(0.2)


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]


def logged(run_dir: Path, key: str) -> list[tuple[int, float]]:
    rows = []
    for path in sorted(run_dir.glob("logs/version_*/metrics.csv")):
        with open(path) as f:
            rows += [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]
    return rows


@pytest.fixture(scope="module")
def straight(cluster, kjv_data, tmp_path_factory) -> Path:
    """An uninterrupted 2-task job: it must complete with its checkpoint and logs in the run directory."""
    tmp = tmp_path_factory.mktemp("slurm-straight")
    run_dir = tmp / "run"
    job = submit(cluster, "--", "--config", str(config_file(tmp, kjv_data)), "--run_dir", str(run_dir))
    info = wait_until_ended(cluster, job)
    assert info["JobState"] == "COMPLETED", (run_dir / "slurm" / f"job-{job}.err").read_text()[-3000:]
    return run_dir


def test_two_task_training_job_completes(straight):
    assert newest_checkpoint(straight / "checkpoints").name == f"step={STEPS:08d}.ckpt"
    job = (straight / "slurm" / "jobs.jsonl").read_text().split('"job": "')[1].split('"')[0]
    out = (straight / "slurm" / f"job-{job}.out").read_text()
    err = (straight / "slurm" / f"job-{job}.err").read_text()
    assert f"lm slurm: job {job} restart 0" in out
    assert "2 processes x micro_batch 2" in err and "MEMBER: 2/2" in err
    assert [s for s, _ in logged(straight, "train/loss")][-1] == STEPS
    assert logged(straight, "slurm/restart_count") == [(0, 0.0)]
    assert list((straight / "slurm").glob("train-*.yaml")) and (straight / "config.yaml").is_file()


@pytest.fixture(scope="module")
def preempted(cluster, kjv_data, tmp_path_factory) -> tuple[Path, str]:
    """DDP on 2 nodes x 1 process, stopped with SIGUSR1 mid-run: it checkpoints, requeues itself and finishes."""
    tmp = tmp_path_factory.mktemp("slurm-preempted")
    run_dir = tmp / "run"
    job = submit(cluster, "--", "--config", str(config_file(tmp, kjv_data, devices=1, nodes=2)), "--run_dir",
                 str(run_dir), "--trainer.wandb", "true")
    wait_for_a_checkpoint(cluster, job, run_dir)
    subprocess.run(["scancel", "--signal=USR1", job], env=cluster, check=True)
    return run_dir, job


def test_a_preempted_2_node_job_requeues_and_ends_with_the_1_node_weights(cluster, straight, preempted):
    """The ranks on two hosts (network namespaces, their own addresses and hostnames) meet over the bridge; the stop
    notice reaches both, the requeued job resumes, and the final weights are the uninterrupted 1-node job's, bit for
    bit: DDP on 2 processes reduces the same two gradients whichever hosts they are on."""
    run_dir, job = preempted
    info = wait_until_ended(cluster, job)
    out = (run_dir / "slurm" / f"job-{job}.out").read_text()
    err = (run_dir / "slurm" / f"job-{job}.err").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, err[-3000:])
    assert info["NumNodes"] == "2" and "lm-node[1-2]" in out  # the job line names both nodes
    assert "MEMBER: 2/2" in err and "2 processes x micro_batch 2" in err
    stopped = int(re.search(r"stopped on request at step (\d+)", err).group(1))
    assert 0 < stopped < STEPS, "the signal must land mid-run"
    assert "requeueing it" in out and f"lm slurm: job {job} restart 1" in out
    assert f"lm train: resuming from {run_dir}/checkpoints/step={stopped:08d}.ckpt" in err
    assert (stopped, 1.0) in logged(run_dir, "slurm/restart_count")
    final = f"checkpoints/step={STEPS:08d}.ckpt"
    expected, got = weights(straight / final), weights(run_dir / final)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step=*.ckpt")) == \
        [f"step={STEPS - 20:08d}.ckpt", f"step={STEPS:08d}.ckpt"]  # keep_last 2, the stop's one included
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and {p.name.rsplit("-", 1)[1] for p in wandb_runs} == \
        {(run_dir / "wandb_id").read_text()}  # both launches log to one wandb run
    status = lm_here(cluster, "slurm", "status", str(run_dir))
    assert re.search(rf"job {job}\s+train COMPLETED\s+restarts 1", status), status
    assert f"last logged step {STEPS}; newest checkpoint step={STEPS:08d}.ckpt" in status  # both count steps done


@pytest.fixture(scope="module")
def sharded(cluster, strategy_runs, tmp_path_factory) -> dict[str, Path]:
    """ZeRO-2 and FSDP2 on 2 nodes x 1 process, each the same run as tests/test_scale_out.py's on one machine with 2
    processes (the conftest's `strategy_runs`, checkpoints at steps 2 and 4); the two jobs run at once, one CPU of
    each node apiece. Their run directories by strategy."""
    tmp = tmp_path_factory.mktemp("slurm-sharded")
    jobs = {}
    for strategy in ("zero2", "fsdp2"):
        flags = [*LOCAL_STRATEGIES[strategy], "--strategy.devices", "1", "--strategy.num_nodes", "2"]
        jobs[strategy] = tmp / strategy, submit(cluster, "--mem", "1G", "--", "--config",
                                                 str(strategy_runs["config"]), "--run_dir", str(tmp / strategy),
                                                 *flags)
    for run_dir, job in jobs.values():
        info = wait_until_ended(cluster, job)
        assert info["JobState"] == "COMPLETED", (run_dir / "slurm" / f"job-{job}.err").read_text()[-3000:]
    return {strategy: run_dir for strategy, (run_dir, _) in jobs.items()}


@pytest.mark.parametrize("strategy", ["zero2", "fsdp2"])
def test_sharded_strategies_on_2_nodes_end_with_the_1_node_weights(sharded, strategy_runs, strategy):
    """Bit for bit: the same 2 ranks reduce in the same order whichever hosts hold them (gloo over 2 ranks), so there
    is no float rounding to allow for. The shards each rank wrote on its own host join into the same weights."""
    from lm.training.consolidate import full_checkpoint

    final = "checkpoints/step=00000004.ckpt"
    one, two = (full_checkpoint(run / final)["state_dict"] for run in (strategy_runs[strategy], sharded[strategy]))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    out = next((sharded[strategy] / "slurm").glob("job-*.out")).read_text()
    assert "on lm-node[1-2]" in out


def test_a_2_node_checkpoint_on_one_node_continues_or_is_refused_as_the_resume_matrix_says(cluster, preempted, sharded,
                                                                                           kjv_data, tmp_path, capsys):
    """The 2-node DDP run's plain checkpoint continues in one process on one node, optimizer state and all; DeepSpeed's
    shards continue only at their own world size, so one process is refused in one line before anything is written."""
    run_dir, job = preempted
    wait_until_ended(cluster, job)
    config = config_file(tmp_path, kjv_data, devices=1, max_steps=STEPS + 2)
    longer = ["--trainer.allow_schedule_change", "true"]  # 2 steps past the checkpoint's schedule, on purpose
    ddp = run_dir / "checkpoints" / f"step={STEPS:08d}.ckpt"
    assert main(["train", "--config", str(config), "--run_dir", str(tmp_path / "single"), "--resume", str(ddp),
                 *longer]) == 0
    err = capsys.readouterr().err
    assert f"lm train: resuming from {ddp}" in err and "fresh optimizer state" not in err
    assert newest_checkpoint(tmp_path / "single" / "checkpoints").name == f"step={STEPS + 2:08d}.ckpt"
    zero2 = sharded["zero2"] / "checkpoints" / "step=00000004.ckpt"
    refused = ["train", "--config", str(config), "--run_dir", str(tmp_path / "zero2"), "--strategy.name", "deepspeed",
               "--strategy.zero_stage", "2", "--resume", str(zero2), *longer]
    assert main(refused) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot resume DeepSpeed ZeRO-2 on 1 processes" in err and "\n" not in err, err
    assert not (tmp_path / "zero2").exists()


def test_a_stop_notice_during_startup_ends_at_once_in_one_line(kjv_data, tmp_path):
    """A preemption notice can come while Python is still importing torch: the run ends at once with one line and
    exit 75 (the job script requeues it), nothing written, rather than dying of the signal or training first."""
    run_dir = tmp_path / "run"
    config = config_file(tmp_path, kjv_data, devices=1, max_steps=50)
    process = subprocess.Popen([sys.executable, "-m", "lm.cli", "train", "--config", str(config), "--run_dir",
                                str(run_dir)], env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)
    time.sleep(0.5)  # the CLI listens from its first lines; torch and Lightning take seconds more to import
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == STOPPED_EXIT_CODE, stderr[-2000:]
    assert stderr.strip().splitlines() == ["lm train: SIGUSR1 before the first step: stopped at once, nothing to save; "
                                           "run again to start"]
    assert not run_dir.exists()


MISLAUNCHES = [
    ("--ntasks=1 --wrap='srun {lm} train --config {config} --run_dir {run}'",
     "SLURM_NTASKS is 1 but the run needs strategy.num_nodes x strategy.devices = 2 processes"),
    ("--ntasks=2 --wrap='{lm} train --config {config} --run_dir {run}'",
     "lm train was started without srun"),
]


def ladder_file(tmp: Path, kjv_data: str) -> Path:
    """Three rungs of attention, the lr swept on the two smallest, each run a single process."""
    (tmp / "base.yaml").write_text(f"""
seed: 0
model: {{vocab_size: 512, max_seq_len: 32}}
data: {{path: {kjv_data}, seq_len: 32, micro_batch: 4, global_batch: 4, num_workers: 0, val_windows: 4}}
optim: {{lr: 3.0e-3, warmup_steps: 5}}
trainer: {{val_every: 1000000, ckpt_every: 20, keep_last: 2, log_every: 5, progress_bar: false}}
strategy: {{accelerator: cpu, devices: 1}}
""")
    (tmp / "ladder.yaml").write_text("""
archs: [attention]
rungs: [1.0e5, 1.5e5, 2.2e5]
base: base.yaml
tokens_per_param: 0.25
lr: {grid: [3.0e-3], sweep_rungs: 2, against: params}
""")
    return tmp / "ladder.yaml"


def stop_at_its_first_checkpoint(env: dict, job: str, run_dir: Path, *scancel: str) -> None:
    wait_for_a_checkpoint(env, job, run_dir, timeout=300)  # it may wait in the queue behind the others
    subprocess.run(["scancel", *scancel, job], env=env, check=True)


def preempt_the_largest_rung(env: dict, ladder: subprocess.Popen, largest: Path) -> tuple[int, str]:
    """SIGUSR1 to the largest rung's task at its first checkpoint; the ladder's exit status and stderr."""
    try:
        deadline = time.time() + 300
        while newest_checkpoint(largest / "checkpoints", warn=False) is None:
            assert ladder.poll() is None, ladder.communicate()[1][-3000:]
            assert time.time() < deadline, f"no checkpoint in {largest} after 300 s"
            time.sleep(0.1)
        task = re.findall(r'"job": "(\d+_\d+)"', (largest / "slurm" / "jobs.jsonl").read_text())[-1]
        subprocess.run(["scancel", "--signal=USR1", task], env=env, check=True)
        _, stderr = ladder.communicate(timeout=300)
    finally:
        ladder.kill()
    return ladder.returncode, stderr


@pytest.fixture(scope="module")
def at_once(cluster, straight, kjv_data, tmp_path_factory, request) -> dict:
    """The jobs of the tests below, none of which needs another's result, submitted together so that the cluster runs
    them side by side rather than one after another (`--mem 1G` where one process will do, so that two share a
    node); each test then waits on its own job and asserts on it alone. The ladder goes first (its stages queue one
    after another), then the jobs to stop mid-run, which a thread stops at their first checkpoint, then the short
    ones. What each test needs, by name; the jobs still queued at the end are cancelled."""
    pool, jobs, entries = ThreadPoolExecutor(max_workers=3), [], {}

    tmp = tmp_path_factory.mktemp("slurm-ladder")
    out = tmp / "out"
    ladder = subprocess.Popen([sys.executable, "-m", "lm.cli", "compare", "ladder", str(ladder_file(tmp, kjv_data)),
                               "--out", str(out), "--where", "slurm", "--slurm", '["--mem=1G"]'], env=cluster,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    largest = out / "runs" / "attention-220k-lr0.003-seed1"  # the rule carries the one lr up; seeds: [1] by default

    def cancel_what_is_left() -> None:  # what a failed test or setup left behind
        ladder.kill()
        ladders = [job for path in largest.parent.glob("*/slurm/jobs.jsonl")
                   for job in re.findall(r'"job": "([\d_]+)"', path.read_text())]
        subprocess.run(["scancel", *jobs, *ladders], env=cluster, capture_output=True)
        pool.shutdown(wait=False)

    request.addfinalizer(cancel_what_is_left)
    entries["ladder"] = out, largest, pool.submit(preempt_the_largest_rung, cluster, ladder, largest)
    deadline = time.time() + 120  # until its lr sweep is in the queue, ahead of the rest
    while not list(out.glob("runs/*/slurm/jobs.jsonl")) and ladder.poll() is None and time.time() < deadline:
        time.sleep(0.2)

    for name, config, scancel in (("term", dict(max_steps=40, ckpt_every=10), ["--signal=TERM"]),
                                  ("cancelled", {}, [])):
        tmp = tmp_path_factory.mktemp(f"slurm-{name}")
        extra = ["--data.num_workers", "1"] if name == "term" else []
        job = submit(cluster, "--", "--config", str(config_file(tmp, kjv_data, **config)), "--run_dir",
                     str(tmp / "run"), *extra)
        jobs.append(job)
        entries[name] = tmp / "run", job, pool.submit(stop_at_its_first_checkpoint, cluster, job, tmp / "run",
                                                      *scancel)

    tmp = tmp_path_factory.mktemp("slurm-array")
    config = config_file(tmp, kjv_data, devices=1, max_steps=10, ckpt_every=10)
    sweep = tmp / "sweep.yaml"
    sweep.write_text(f"""
common: {{config: {config}}}
runs:
  - {{optim.lr: 1.0e-3, run_dir: {tmp}/lr1e-3}}
  - {{optim.lr: 3.0e-3, run_dir: {tmp}/lr3e-3}}
""")
    # 1G each rather than the whole node (sbatch's default here): the two tasks run at once, as on a real cluster.
    entries["array"] = tmp, submit(cluster, "--array", str(sweep), "--job_dir", str(tmp / "sweep"), "--mem", "1G")
    jobs += [f"{entries['array'][1]}_{task}" for task in range(2)]

    entries["eval"] = submit(cluster, "--kind", "eval", "--gpus_per_node", "0", "--mem", "1G", "--", "ppl",
                             "--checkpoint", str(straight), "--max_windows", "8", "--out",
                             str(straight / "eval" / "slurm-ppl"))
    jobs.append(entries["eval"])

    for launch, _ in MISLAUNCHES:
        tmp = tmp_path_factory.mktemp("slurm-mislaunch")
        args = launch.format(lm=f"{sys.executable} -m lm.cli", config=config_file(tmp, kjv_data), run=tmp / "run")
        job = subprocess.run(f"sbatch --parsable --mem=1G --chdir={ROOT} --error={tmp / 'job.err'} "
                             f"--output=/dev/null {args}", shell=True, env=cluster, capture_output=True, text=True,
                             check=True).stdout.strip()
        jobs.append(job)
        entries[launch] = tmp / "job.err", job

    tmp = tmp_path_factory.mktemp("slurm-dry-run")
    config = config_file(tmp, kjv_data, devices=1, max_steps=2, ckpt_every=2)
    script = tmp / "printed.sbatch"
    script.write_text(lm_here(cluster, "slurm", "submit", "--dry_run", "true", "--mem", "1G", "--", "--config",
                              str(config), "--run_dir", str(tmp / "run")))
    job = subprocess.run(["sbatch", "--parsable", str(script)], env=cluster, capture_output=True, text=True,
                         check=True).stdout.strip()
    jobs.append(job)
    entries["dry-run"] = tmp / "run", job

    from lm.mixers import MIXERS

    tmp = tmp_path_factory.mktemp("slurm-grid")
    out, mixer = tmp / "grid", sorted(MIXERS)[0]
    command = ["mqar-grid", "--quick", "true", "--mixers", f"[{mixer}]", "--out", str(out)]
    tasks = lm_here(cluster, "eval", *command, "--cell", "-1").strip()
    job = submit(cluster, "--kind", "eval", "--tasks", tasks, "--gpus_per_node", "0", "--mem", "1G", "--", *command)
    jobs += [f"{job}_{task}" for task in range(int(tasks))]
    entries["grid"] = out, mixer, tasks, job

    tmp = tmp_path_factory.mktemp("slurm-prepare")
    corpus = prepare_corpus(tmp)
    printed = lm_here(cluster, "slurm", "submit", "--kind", "prepare", "--tasks", "2", "--mem", "1G", "--",
                      "--inputs", f"[{corpus}]", "--out", str(tmp / "data"), *PREPARE).split()
    array, merge = printed[-2:]
    jobs += [f"{array}_0", f"{array}_1", merge]
    entries["prepare"] = corpus, tmp / "data", array, merge, job_info(cluster, merge)["Dependency"]

    return entries


def test_a_cancelled_job_is_not_requeued(cluster, at_once):
    """A plain scancel mid-run: the run checkpoints, and the job ends CANCELLED, not requeued."""
    run_dir, job, stopped = at_once["cancelled"]
    stopped.result()
    info = wait_until_ended(cluster, job)
    # A wrongly requeued job would be pending again 3 s after its end (EndTime is to the second: 4).
    time.sleep(max(0.0, datetime.fromisoformat(info["EndTime"]).timestamp() + 4 - time.time()))
    info = job_info(cluster, job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    assert "requeueing" not in (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert newest_checkpoint(run_dir / "checkpoints") is not None


def test_a_term_to_every_task_checkpoints_exits_75_and_the_job_resumes(cluster, at_once):
    """`scancel --signal=TERM` reaches every process of the job step, the data-loader workers among them: the run
    checkpoints at the next step and exits 75 (no worker dies of it), and the job script requeues it as it does for a
    preemption notice; the requeued job resumes and completes."""
    run_dir, job, stopped = at_once["term"]  # 40 steps, a checkpoint every 10, a data-loader worker
    stopped.result()
    info = wait_until_ended(cluster, job)
    err = (run_dir / "slurm" / f"job-{job}.err").read_text()
    out = (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, err[-3000:])
    assert "lm train: SIGTERM: stopping at the next step with a checkpoint" in err, err[-3000:]
    assert "stopped on request at step" in err and "DataLoader worker" not in err and "Traceback" not in err
    assert "stopped with a checkpoint; requeueing it" in out
    assert newest_checkpoint(run_dir / "checkpoints").name == "step=00000040.ckpt"


def test_array_of_two_configs_runs_both(cluster, at_once):
    """A sweep file of two lrs (10 steps each, one process) as an array job: each task trains its own run."""
    tmp_path, job = at_once["array"]
    for task, lr in ((0, "1e-3"), (1, "3e-3")):
        info = wait_until_ended(cluster, f"{job}_{task}")
        run_dir = tmp_path / f"lr{lr}"
        err = (run_dir / "slurm" / f"job-{job}_{task}.err").read_text()
        assert info["JobState"] == "COMPLETED", err[-3000:]
        assert newest_checkpoint(run_dir / "checkpoints").name == "step=00000010.ckpt"
        assert logged(run_dir, "train/lr")[-1][1] <= float(lr)
        assert f'"job": "{job}_{task}"' in (run_dir / "slurm" / "jobs.jsonl").read_text()
    assert "lr: 0.001" in next((tmp_path / "lr1e-3" / "slurm").glob("train-*.yaml")).read_text()


def test_eval_job_writes_its_results_into_the_run(cluster, straight, at_once):
    job = at_once["eval"]  # lm eval ppl on the straight run
    info = wait_until_ended(cluster, job)
    assert info["JobState"] == "COMPLETED", (straight / "slurm" / f"job-{job}.err").read_text()[-3000:]
    assert (straight / "eval" / "slurm-ppl" / "ppl.json").is_file()


# The guards: each ends with one clear error rather than a hang or a silent mis-launch.

def test_a_run_directory_with_a_live_job_is_refused(cluster, kjv_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CONF", cluster["SLURM_CONF"])
    args = ["--", "--config", str(config_file(tmp_path, kjv_data)), "--run_dir", str(tmp_path / "run")]
    held = submit_from_args(["--sbatch", "[--hold]", *args])  # pending until released: live
    try:
        with pytest.raises(UserError, match=f"is already being trained by live job {held} \\(PENDING\\)"):
            submit_from_args(args)
    finally:
        subprocess.run(["scancel", held], env=cluster)


@pytest.mark.parametrize("launch, message", MISLAUNCHES)
def test_a_mislaunched_training_job_ends_with_a_clear_error(cluster, at_once, launch, message):
    """A 2-process run submitted with sbatch by hand (--wrap LAUNCH): one task, or two without srun."""
    log, job = at_once[launch]
    info = wait_until_ended(cluster, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    assert message in log.read_text() and "Traceback" not in log.read_text()


def test_a_job_script_without_srun_stops_at_once(kjv_data, tmp_path, capsys):
    submit_from_args(["--dry-run", "--", "--config", str(config_file(tmp_path, kjv_data)), "--run_dir",
                      str(tmp_path / "run")])
    script = capsys.readouterr().out
    (tmp_path / "job.sh").write_text(script)
    result = subprocess.run(["/bin/bash", str(tmp_path / "job.sh")], env={"PATH": "/nonexistent"},
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("lm slurm: srun is not on PATH on")


def test_a_dry_runs_script_submitted_with_sbatch_as_printed_completes(cluster, at_once):
    """`lm slurm submit --dry_run true` printed the script (2 steps, one process); sbatch submitted it as it is."""
    run_dir, job = at_once["dry-run"]
    info = wait_until_ended(cluster, job)
    assert info["JobState"] == "COMPLETED", info
    assert f"lm slurm: job {job} restart 0" in (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert newest_checkpoint(run_dir / "checkpoints").name == "step=00000002.ckpt"


def test_a_second_live_trainer_of_a_run_directory_is_refused(kjv_data, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / LOCK_NAME, "a+") as lock:  # as a live run would hold it
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write('{"pid": 1234, "host": "elsewhere"}')
        lock.flush()
        result = lm({**os.environ, "OMP_NUM_THREADS": "1"}, "train", "--config",
                    str(config_file(tmp_path, kjv_data, devices=1, max_steps=2)), "--run_dir", str(run_dir),
                    check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "is being trained by another live process" in result.stderr and '"pid": 1234' in result.stderr
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())


def test_sweep_files_are_checked(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("common: {config: [a.yaml, b.yaml], trainer.max_steps: 5}\nruns:\n  - {run_dir: r1}\n"
                     "  - {run_dir: r2, optim.lr: 1.0e-3, model.layer_pattern: [attention, mamba2]}\n")
    assert sweep_runs(str(sweep)) == [
        ["--config", "a.yaml", "--config", "b.yaml", "--trainer.max_steps", "5", "--run_dir", "r1"],
        ["--config", "a.yaml", "--config", "b.yaml", "--trainer.max_steps", "5", "--run_dir", "r2",
         "--optim.lr", "0.001", "--model.layer_pattern", "[attention, mamba2]"]]
    sweep.write_text("runs: {a: 1}\n")
    with pytest.raises(UserError, match="needs `runs:`"):
        sweep_runs(str(sweep))
    sweep.write_text("run: []\n")
    with pytest.raises(UserError, match="needs `runs:`"):
        sweep_runs(str(sweep))
    with pytest.raises(UserError, match="not found"):
        sweep_runs(str(tmp_path / "missing.yaml"))


def test_sweep_runs_must_not_share_a_run_directory(kjv_data, tmp_path):
    config = config_file(tmp_path, kjv_data, devices=1)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"common: {{config: {config}, run_dir: {tmp_path}/same}}\nruns:\n  - {{seed: 1}}\n"
                     "  - {seed: 2}\n")
    with pytest.raises(UserError, match="two runs share a run_dir"):
        submit_from_args(["--dry-run", "--array", str(sweep)])


def test_dry_run_for_4_nodes_of_8_gpus_renders_the_expected_script(tmp_path, monkeypatch, capsys):
    site = tmp_path / "site.yaml"
    site.write_text("partition: gpu\naccount: proj\nqos: high\nconstraint: h100\ncpus_per_task: 12\nmem: '0'\n"
                    "time: '12:00:00'\nsetup: [module load cuda/12.4, source /opt/venv/bin/activate]\n"
                    "python: python\nsbatch: [--mail-type=FAIL]\n")
    run_dir = tmp_path / "runs" / "big"
    monkeypatch.setenv("LM_SLURM_SITE", str(site))
    submit_from_args(["--dry-run", "--nodes", "4", "--gpus-per-node", "8", "--time", "24:00:00", "--exclusive", "--",
                      "--config", str(ROOT / "configs/attention/1b.yaml"), "--run_dir", str(run_dir)])
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=lm-big",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=12",
        "#SBATCH --mem=0",
        "#SBATCH --time=24:00:00",  # the command line over the site file
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=h100",
        "#SBATCH --exclusive",
        "#SBATCH --signal=USR1@300",
        "#SBATCH --requeue",
        f"#SBATCH --chdir={os.getcwd()}",
        f"#SBATCH --output={run_dir}/slurm/job-%j.out",
        f"#SBATCH --error={run_dir}/slurm/job-%j.err",
        "#SBATCH --open-mode=append",
        "#SBATCH --mail-type=FAIL",
    ]
    assert lines.index("module load cuda/12.4") < lines.index("source /opt/venv/bin/activate") < \
        next(i for i, line in enumerate(lines) if line.startswith("command -v srun"))
    frozen = re.fullmatch(rf"ARGS=\(train --config ({run_dir}/slurm/train-[\d-]+\.yaml) --resume auto\)",
                          next(line for line in lines if line.startswith("ARGS="))).group(1)
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in lines
    assert 'export MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"' in lines
    assert 'srun --nodes=4 --ntasks-per-node=8 --cpus-per-task=12 python -m lm.cli "${ARGS[@]}" &' in lines
    assert 'if [ "$status" -eq 75 ] && [ "$stop" != TERM ]; then' in lines
    assert '    scontrol requeue "$SLURM_JOB_ID"' in lines
    # A dry run writes what its script points at, and no more: the frozen config (the command line's shape in it) and
    # the log folder. Nothing is recorded as submitted.
    assert sorted(run_dir.rglob("*")) == [run_dir / "slurm", Path(frozen)]
    strategy = yaml.safe_load(Path(frozen).read_text())["strategy"]
    assert (strategy["num_nodes"], strategy["devices"]) == (4, 8)


@pytest.mark.parametrize("args, message", [
    (["--", "--modle.d_model", "64"], "unknown config key 'modle.d_model'"),
    (["--gpus_per_node", "2", "--"], "--gpus_per_node with strategy.accelerator cpu"),
    (["--nodes", "0", "--"], "--nodes must be at least 1"),
])
def test_a_dry_run_with_bad_input_writes_nothing(kjv_data, tmp_path, args, message):
    cut = args.index("--")
    command = [*args[:cut], "--", "--config", str(config_file(tmp_path, kjv_data)), "--run_dir",
               str(tmp_path / "run"), *args[cut + 1:]]
    with pytest.raises(UserError, match=message):
        submit_from_args(["--dry-run", *command])
    assert not (tmp_path / "run").exists()


def test_site_setup_runs_before_strict_mode(kjv_data, tmp_path, monkeypatch, capsys):
    """A setup line that reads an unset variable (as conda's activate does) runs; strict mode (set -u) holds for the
    rest of the script: with a stand-in srun on PATH, it stops at the first SLURM variable the job would have set."""
    site = tmp_path / "site.yaml"
    site.write_text("setup:\n  - 'activate() { echo \"setup saw [${LM_TEST_UNSET}]\"; }'\n  - activate\n")
    monkeypatch.setenv("LM_SLURM_SITE", str(site))
    submit_from_args(["--dry-run", "--", "--config", str(config_file(tmp_path, kjv_data)), "--run_dir",
                      str(tmp_path / "run")])
    (tmp_path / "job.sh").write_text(capsys.readouterr().out)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    result = subprocess.run(["/bin/bash", str(tmp_path / "job.sh")], env={"PATH": str(tmp_path / "bin")},
                            capture_output=True, text=True)
    assert result.stdout == "setup saw []\n", result.stderr
    assert result.returncode != 0 and re.search(r"SLURM_\w+: unbound variable", result.stderr), result.stderr


def test_bad_submit_options_end_with_one_line(tmp_path):
    result = lm({**os.environ}, "slurm", "submit", "--nodez", "2", "--dry-run", "--", "--config", "x.yaml",
                check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "lm slurm submit: error: unknown config key 'nodez' (did you mean 'nodes'?)"]


def test_a_missing_site_file_named_by_the_environment_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("LM_SLURM_SITE", str(tmp_path / "nowhere.yaml"))
    with pytest.raises(UserError, match="LM_SLURM_SITE names .*nowhere.yaml, which is not a file"):
        submit_from_args(["--dry-run", "--", "--config", "x.yaml"])


# An evaluation grid as an array: task i runs cell i (`lm eval mqar-grid --cell i`), a later call collects.

def test_an_eval_grid_array_renders_one_cell_per_task(tmp_path, capsys):
    out = tmp_path / "grid"
    submit_from_args(["--dry-run", "--kind", "eval", "--tasks", "3", "--gpus_per_node", "0", "--", "mqar-grid",
                      "--quick", "true", "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert "#SBATCH --array=0-2" in lines and "#SBATCH --no-requeue" in lines
    assert f"#SBATCH --output={out}/slurm/array-%A_%a.out" in lines
    assert f"ARGS=(eval mqar-grid --quick true --out {out})" in lines
    assert 'ARGS+=(--cell "$SLURM_ARRAY_TASK_ID")' in lines
    assert sorted(out.rglob("*")) == [out / "slurm"]  # the log folder: the script submits as printed


@pytest.mark.parametrize("args, message", [
    (["--tasks", "2", "--", "--config", "x.yaml"], "--tasks is for --kind eval"),
    (["--kind", "eval", "--tasks", "2", "--", "ppl", "--checkpoint", "x"], "lm eval ppl has none"),
    (["--kind", "eval", "--tasks", "2", "--", "mqar-grid", "--cell", "1"], "drop --cell from the command"),
    (["--kind", "eval", "--tasks", "0", "--", "mqar-grid"], "--tasks must be at least 1"),
    (["--kind", "eval", "--array", "s.yaml", "--", "mqar-grid"], "an evaluation grid is --tasks N"),
])
def test_eval_arrays_are_checked(args, message):
    with pytest.raises(UserError, match=message):
        submit_from_args(["--dry-run", *args])


def test_an_eval_grid_array_runs_each_cell_on_the_cluster(cluster, at_once):
    """The quick grid of one mixer counted its cells (`--cell -1`) and went in as an array of that many tasks."""
    from lm.eval.mqar_grid import mqar_grid

    out, mixer, tasks, job = at_once["grid"]
    assert tasks == "2"
    for task in range(2):
        info = wait_until_ended(cluster, f"{job}_{task}")
        assert info["JobState"] == "COMPLETED", (out / "slurm" / f"array-{job}_{task}.err").read_text()[-3000:]
    assert len(list((out / "cells").glob("*.json"))) == 2
    assert len(mqar_grid(out=str(out), mixers=[mixer], quick=True, processes=1)) == 2  # collects, reruns none
    assert f'"job": "{job}"' in (out / "slurm" / "jobs.jsonl").read_text()


def test_a_ladder_runs_as_arrays_and_survives_a_preempted_task(at_once):
    """`lm compare ladder --where slurm`: the lr sweep as one array job, the rungs as another; the largest rung's task
    is preempted (SIGUSR1) mid-run, requeued, resumes from its checkpoint, and the ladder reports."""
    out, largest, ladder = at_once["ladder"]
    returncode, stderr = ladder.result()
    assert returncode == 0, stderr[-3000:]
    assert "lr-sweep: 2 of 2 runs to train (slurm)" in stderr and "rungs: 3 of 3 runs to train (slurm)" in stderr
    steps = yaml.safe_load((largest / "config.yaml").read_text())["trainer"]["max_steps"]
    assert (largest / "checkpoints" / f"step={steps:08d}.ckpt").is_file()
    restarts = logged(largest, "slurm/restart_count")
    assert restarts[0] == (0, 0.0) and restarts[-1][1] == 1.0 and 0 < restarts[-1][0] < steps, restarts
    report = (out / "report" / "ladder.md").read_text()
    assert "| attention | 3 |" in report  # three rungs: too few for a fit with intervals, and it says so
    assert "3 rung(s) with finished runs: a law of 3 parameters, judged on a rung it did not see, needs 4" in report


# lm prepare as an array: the plan at submission, a part per task, a merge job after them (afterok).

def prepare_corpus(tmp: Path) -> Path:
    """Three files of the bundled corpus's first chapters."""
    import gzip

    from lm.data_prep import BUNDLED_CORPUS

    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        lines = [next(f) for _ in range(240)]
    for i in range(3):
        (tmp / "corpus").mkdir(exist_ok=True)
        (tmp / "corpus" / f"{i}.jsonl").write_text("".join(lines[i * 80:(i + 1) * 80]))
    return tmp / "corpus"


PREPARE = ["--vocab_size", "300", "--shard_tokens", "40000", "--progress", "false"]


def test_a_prepare_array_renders_its_parts_and_a_merge(tmp_path, capsys):
    out = tmp_path / "data"
    command = ["--inputs", f"[{tmp_path}]", "--out", str(out), *PREPARE]
    submit_from_args(["--dry-run", "--kind", "prepare", "--tasks", "3", "--", *command])
    array, merge = capsys.readouterr().out.split("#!/bin/bash\n")[1:]
    array, merge = array.splitlines(), merge.splitlines()
    assert "#SBATCH --array=0-2" in array and "#SBATCH --no-requeue" in array
    assert f"#SBATCH --output={out}/slurm/array-%A_%a.out" in array
    assert f"ARGS=(prepare --inputs '[{tmp_path}]' --out {out} {' '.join(PREPARE)} --tasks 3)" in array
    assert 'ARGS+=(--task "$SLURM_ARRAY_TASK_ID")' in array
    assert not [line for line in merge if "--array" in line or "ARGS+=" in line]
    assert f"ARGS=(prepare --inputs '[{tmp_path}]' --out {out} {' '.join(PREPARE)} --tasks 3 --merge true)" in merge
    assert "#SBATCH --no-requeue" in merge and f"#SBATCH --output={out}/slurm/job-%j.out" in merge
    assert "after the plan step" in array[0] and "afterok" not in array[0] and "afterok" in merge[0]
    assert sorted(out.rglob("*")) == [out / "slurm"]  # the log folder; the plan step is left to the submission


@pytest.mark.parametrize("args, message", [
    (["--kind", "prepare", "--", "--out", "x"], "--kind prepare needs --tasks N"),
    (["--kind", "prepare", "--tasks", "2", "--", "--out", "x", "--task", "1"], "drop --task from the lm prepare"),
    (["--kind", "prepare", "--tasks", "2", "--", "--vocab_sise", "1"], "unknown config key 'vocab_sise'"),
])
def test_prepare_arrays_are_checked(args, message):
    with pytest.raises(UserError, match=message):
        submit_from_args(["--dry-run", *args])


def test_a_prepare_array_and_its_merge_write_the_bytes_of_one_process(cluster, at_once, tmp_path):
    """Two tasks and a merge of the three files' `lm prepare`: the same bytes as one process writes."""
    from lm.data_prep import prepare
    from lm.data_prep.shards import sha256_file

    corpus, out, array, merge, dependency = at_once["prepare"]
    assert dependency.startswith(f"afterok:{array}_*")  # read at submission: the array ends in well over 0.1 s
    digests = lambda d: {p.name: sha256_file(p) for p in sorted(d.iterdir()) if p.is_file()}  # noqa: E731
    prepare([str(corpus)], str(tmp_path / "one"), vocab_size=300, shard_tokens=40000, progress=False)
    for job, log in ((f"{array}_0", f"array-{array}_0"), (f"{array}_1", f"array-{array}_1"), (merge, f"job-{merge}")):
        info = wait_until_ended(cluster, job, timeout=120)
        assert info["JobState"] == "COMPLETED", (out / "slurm" / f"{log}.err").read_text()[-3000:]
    assert digests(out) == digests(tmp_path / "one")
    assert [p.name for p in (out / ".parts").iterdir()] == ["plan.json"]
    assert f'"job": "{merge}", "kind": "merge"' in (out / "slurm" / "jobs.jsonl").read_text()

"""Refuse a mis-launched run before it trains: a SLURM allocation whose task count does not match the strategy,
a multi-process run started inside a SLURM job without `srun`, several nodes asked for outside a launcher that starts
them or started by hand without the address where they meet, torchrun's processes that are not the run's, a strategy
this machine cannot run, or a run directory that another live process is already training. Each would otherwise hang,
fail in a traceback, train with the wrong world size, or interleave two runs' checkpoints. The checks run before
Lightning is imported (lm.training.preflight); the run directory's lock is held by a callback for the whole fit
(lm.training.callbacks.run_dir_lock).
"""

import os
import sys

from lm.training.config import RunConfig, check_mixer_options
from lm.training.stop_request import is_rank_zero
from lm.training.strategy_config import check_strategy
from lm.util.errors import UserError

LOCK_NAME = ".lm-train.lock"  # in the run directory, held by lm.training.callbacks.run_dir_lock.RunDirLock


def check_slurm_launch(world_size: int, env=os.environ) -> None:
    """Inside a SLURM job, the processes must come from `srun`, one per device: SLURM_NTASKS = nodes x devices."""
    if "SLURM_JOB_ID" not in env or "SLURM_NTASKS" not in env:
        return
    ntasks = int(env["SLURM_NTASKS"])
    if "SLURM_STEP_ID" not in env:  # the batch script itself, not a task that srun started
        if world_size > 1 or ntasks > 1:
            # srun starts the job's tasks: where they are not the run's processes, it needs another job too
            resubmit = "" if ntasks == world_size else \
                ", in a job submitted with --nodes=num_nodes and --ntasks-per-node=devices"
            raise UserError(f"SLURM job {env['SLURM_JOB_ID']} has {ntasks} task{'s' * (ntasks != 1)} and the run "
                            f"needs {world_size} process{'es' * (world_size != 1)}, but lm train was started without "
                            f"srun: launch it with `srun lm train ...`{resubmit} (lm slurm submit does)")
        return
    if ntasks != world_size:
        raise UserError(f"SLURM_NTASKS is {ntasks} but the run needs strategy.num_nodes x strategy.devices = "
                        f"{world_size} processes: submit with --nodes=num_nodes and --ntasks-per-node=devices "
                        f"(lm slurm submit does)")


def check_nodes_launch(num_nodes: int, env=os.environ) -> None:
    """Several nodes need a launcher that starts a process on each: srun (SLURM), torchrun, or each node started by
    hand with MASTER_ADDR, MASTER_PORT and NODE_RANK. Without one, the first node would wait for the others forever."""
    if num_nodes == 1 or "SLURM_JOB_ID" in env:  # inside a job, check_slurm_launch checks the tasks
        return
    if not any(name in env for name in ("WORLD_SIZE", "MASTER_ADDR", "NODE_RANK", "TORCHELASTIC_RUN_ID")):
        raise UserError(f"strategy.num_nodes {num_nodes} needs a launcher that starts every node: submit with "
                        "`lm slurm submit` (srun), or start each node with torchrun (or MASTER_ADDR, MASTER_PORT and "
                        "NODE_RANK); started alone, this node would wait for the others forever")


def check_hand_launch(num_nodes: int, env=os.environ) -> None:
    """Nodes started by hand (no srun, no torchrun) meet at MASTER_ADDR:MASTER_PORT, which every node must be given:
    without MASTER_PORT Lightning has each node pick a free port of its own, and without MASTER_ADDR a node looks for
    the first on itself; either way each would wait for the others forever."""
    if num_nodes == 1 or "SLURM_JOB_ID" in env or "TORCHELASTIC_RUN_ID" in env:
        return
    if missing := [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]:
        raise UserError(f"strategy.num_nodes {num_nodes} started by hand needs {' and '.join(missing)} set alike on "
                        f"every node (and NODE_RANK 0 to {num_nodes - 1}): without it each node would wait for the "
                        "others forever")


def check_torchrun_launch(world_size: int, env=os.environ) -> None:
    """torchrun's processes must be the run's: WORLD_SIZE = strategy.num_nodes x strategy.devices. More would each
    train on its own in one run directory (a one-device run) or fail in a traceback; fewer would wait forever."""
    if "TORCHELASTIC_RUN_ID" in env and "WORLD_SIZE" in env and int(env["WORLD_SIZE"]) != world_size:
        raise UserError(f"torchrun started {env['WORLD_SIZE']} processes but the run needs strategy.num_nodes x "
                        f"strategy.devices = {world_size}: start it with torchrun --nnodes=num_nodes "
                        "--nproc_per_node=devices")


def check_launch(config: RunConfig) -> None:
    """Everything the launch and the strategy ask of this machine (a RunConfig's), before `lm train` writes
    anything; a silent change the Trainer would make is said once, on stderr."""
    st = config.strategy
    check_mixer_options(config.model)
    check_slurm_launch(st.world_size)
    check_nodes_launch(st.num_nodes)
    check_hand_launch(st.num_nodes)
    check_torchrun_launch(st.world_size)
    check_strategy(st, config.optim.grad_clip, config.data.micro_batch)
    if st.precision_notice and is_rank_zero():
        print(f"lm train: warning: {st.precision_notice}", file=sys.stderr)


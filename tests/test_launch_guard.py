"""The SLURM launch check (lm.training.launch_guard.check_slurm_launch) from both sides of each of its decisions, at
the level of the environment SLURM gives a process: outside a job anything goes; in the batch script itself only one
process of a one-task job; in a task that srun started, exactly one task per process of the run. In-process: the real
cluster's launches are tests/test_slurm.py's."""

import pytest

from lm.training.launch_guard import check_slurm_launch
from lm.util.errors import UserError

JOB = {"SLURM_JOB_ID": "7"}
SRUN = {**JOB, "SLURM_STEP_ID": "0"}  # a task that srun started


def test_outside_a_slurm_job_any_world_size_goes():
    check_slurm_launch(2, {})
    check_slurm_launch(2, {"SLURM_NTASKS": "1"})  # a leftover variable without a job
    check_slurm_launch(2, JOB)  # a job that does not say its tasks: Lightning takes no SLURM layout from it


def test_in_the_batch_script_only_one_process_of_a_one_task_job_goes():
    """Without srun, one process in a one-task job is a plain run. Two processes in a one-task allocation (devices 2)
    would be started by Lightning itself, in an allocation that gave it one task; a job of several tasks needs srun
    to start them: both refused, saying how to launch it."""
    check_slurm_launch(1, {**JOB, "SLURM_NTASKS": "1"})
    for world_size, ntasks in ((2, 1), (1, 2), (2, 2), (4, 2)):
        with pytest.raises(UserError, match="started without srun") as refused:
            check_slurm_launch(world_size, {**JOB, "SLURM_NTASKS": str(ntasks)})
        assert f"has {ntasks} task" in str(refused.value) and f"needs {world_size} process" in str(refused.value)
        # where the job's tasks are not the run's, srun alone would not do: the job must be submitted again
        assert ("--ntasks-per-node=devices" in str(refused.value)) == (ntasks != world_size), str(refused.value)


def test_under_srun_there_is_one_task_per_process_of_the_run():
    for world_size in (1, 2, 8):
        check_slurm_launch(world_size, {**SRUN, "SLURM_NTASKS": str(world_size)})
    for world_size, ntasks in ((2, 1), (8, 4), (1, 2), (2, 4)):  # fewer tasks would wait forever; more train apart
        with pytest.raises(UserError, match=f"SLURM_NTASKS is {ntasks} but the run needs .* = {world_size} processes"):
            check_slurm_launch(world_size, {**SRUN, "SLURM_NTASKS": str(ntasks)})

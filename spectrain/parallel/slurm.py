"""Runs started by SLURM's `srun` (one task per rank, on one node or many): the ranks read torchrun's variables.

`srun` starts every rank itself, so nothing is relaunched; Lightning's `SLURMEnvironment` reads the task's global
rank, node, local rank and the job's main address (the first node of `SLURM_NODELIST`) and port (from the job id,
or `MASTER_PORT`), and they are written as the variables torchrun would set. From there a run under `srun` takes
the same path as one under torchrun: the process group over `env://`, `TorchElasticEnvironment` in Lightning.
A job of several tasks run without `srun` (from its batch script) is refused: its ranks would wait for tasks that
nobody starts.
"""
from __future__ import annotations

import os

from spectrain.errors import ConfigError


def adopt_slurm_environment() -> bool:
    """Under `srun` and not under torchrun: set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
    MASTER_ADDR, MASTER_PORT and TORCHELASTIC_RUN_ID from SLURM's variables; whether it did (idempotent)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return False
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return False
    check_tasks_launched()
    slurm = SLURMEnvironment()
    try:
        per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", "1"))
    except ValueError:
        raise ConfigError(f"SLURM_NTASKS_PER_NODE is {os.environ['SLURM_NTASKS_PER_NODE']!r}: start the ranks with "
                          f"`srun --ntasks-per-node=N` (one task per GPU, the same N on every node)") from None
    if slurm.world_size() % per_node != 0:
        raise ConfigError(f"srun started {slurm.world_size()} tasks, not a multiple of --ntasks-per-node={per_node}: "
                          f"give every node the same number of tasks")
    os.environ.update(RANK=str(slurm.global_rank()), WORLD_SIZE=str(slurm.world_size()),
                      LOCAL_RANK=str(slurm.local_rank()), LOCAL_WORLD_SIZE=str(per_node),
                      GROUP_RANK=str(slurm.node_rank()), MASTER_ADDR=slurm.main_address,
                      MASTER_PORT=str(slurm.main_port), TORCHELASTIC_RUN_ID=f"slurm-{slurm.job_id()}")
    return True


def check_tasks_launched() -> None:
    """Refuse a process that is not one of the job's SLURM_NTASKS tasks: a batch script (or an `salloc` shell) runs
    outside any job step, and its ranks would wait for the others, which nobody starts. `srun` starts the tasks of
    a step and sets SLURM_STEP_NUM_TASKS; the batch step sets no step variables."""
    tasks = os.environ["SLURM_NTASKS"]
    step_tasks = os.environ.get("SLURM_STEP_NUM_TASKS")
    if step_tasks == tasks or (step_tasks is None and tasks == "1"):
        return
    if step_tasks is None:
        raise ConfigError(f"SLURM_NTASKS={tasks}: the job has {tasks} tasks, one per rank, but this process runs in "
                          f"the batch script, outside any job step (no SLURM_STEP_NUM_TASKS): nobody started the other "
                          f"tasks, and the ranks would wait for them forever; start the ranks with `srun spectrain "
                          f"fit ...` in the batch script")
    raise ConfigError(f"SLURM_NTASKS={tasks} but srun started SLURM_STEP_NUM_TASKS={step_tasks} tasks (srun -E keeps "
                      f"the allocation's SLURM_NTASKS), and the ranks would wait for the missing ones forever; run "
                      f"`srun spectrain fit ...` without -E (srun sets both to its --ntasks)")

"""Runs started by SLURM's `srun` (one task per rank, on one node or many): the ranks read torchrun's variables.

`srun` starts every rank itself, so nothing is relaunched; Lightning's `SLURMEnvironment` reads the task's global
rank, node, local rank and the job's main address (the first node of `SLURM_NODELIST`) and port (from the job id,
or `MASTER_PORT`), and they are written as the variables torchrun would set. From there a run under `srun` takes
the same path as one under torchrun: the process group over `env://`, `TorchElasticEnvironment` in Lightning.
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

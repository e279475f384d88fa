"""vLLM's process groups in a multi-process run, built on every rank before the ranks start their engines."""
from __future__ import annotations

import torch.distributed as dist

from spectrain.rollout.vllm import compat


def prepare_process_groups(tensor_parallel_size: int) -> None:
    """On every rank (collective), over the run's default process group.

    vLLM joins an existing default process group and builds its groups over all of it with
    `new_group`, which every rank must call; so all ranks build them here, with TP groups of
    `tensor_parallel_size` consecutive ranks, and each rank's in-process engine finds its own ready.
    """
    compat.init_process_groups(dist.get_world_size(), dist.get_rank(), tensor_parallel_size)

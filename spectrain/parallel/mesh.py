"""The one named device mesh of a run: ``("pp", "dp", "cp")``.

``cp`` is innermost so a CP group (the ring, the heaviest traffic) is made of neighbouring
ranks (one node), then ``dp``, then ``pp`` outermost (pipeline P2P is the lightest).
Code takes the group it needs from the mesh (``mesh["cp"].get_group()``), never WORLD.
"""
from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from spectrain.parallel.torch_compat import flatten_dense_tensors, unflatten_dense_tensors

MESH_DIMS = ("pp", "dp", "cp")
ROLLOUT_RANK = 0  # global rank that drives the engine (mesh coordinate (0, 0, 0))


def world_size() -> int:
    """Processes of this run: the process group's, else the launcher's (torchrun) environment."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def check_mesh_shape(pp: int, dp: int, cp: int, world: int) -> None:
    """A ValueError naming the fix unless ``pp x dp x cp`` is exactly the world."""
    bad = [f"parallel.{k}={v}" for k, v in (("pp", pp), ("dp", dp), ("cp", cp)) if v < 1]
    if bad:
        raise ValueError(f"{', '.join(bad)}: every mesh size must be >= 1")
    if pp * dp * cp != world:
        fit = (f"set parallel.dp={world // (pp * cp)}" if world % (pp * cp) == 0 else
               f"parallel.pp x parallel.cp = {pp * cp} does not divide {world}: pick sizes whose product divides it")
        raise ValueError(
            f"parallel.pp x parallel.dp x parallel.cp = {pp} x {dp} x {cp} = {pp * dp * cp}, but the world has "
            f"{world} process(es). Launch {pp * dp * cp} processes (`spectrain fit` launches pp*dp*cp itself; "
            f"torchrun needs --nproc-per-node {pp * dp * cp}), or fit the mesh to {world}: {fit}")


def build_mesh(pp: int, dp: int, cp: int, device_type: str = "cpu") -> DeviceMesh:
    """A ``pp x dp x cp`` mesh over every process; the sizes must multiply to the world size."""
    check_mesh_shape(pp, dp, cp, world_size())
    return init_device_mesh(device_type, (pp, dp, cp), mesh_dim_names=MESH_DIMS)


def by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype (and device), groups and members in first-seen order (flat collectives need one
    dtype on one device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.dtype, t.device].append(t)
    return list(groups.values())


def all_reduce_gradients(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum `module`'s gradients over `group`, in place, one flat all-reduce per dtype.

    Every rank of `group` must have gradients for the same parameters (they run the same graph). FSDP-sharded
    parameters are left out: their gradients were reduce-scattered over `group` in the backward.
    """
    if dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in module.parameters() if p.grad is not None and not isinstance(p.grad, DTensor)]
    for bucket in by_dtype(grads):
        flat = flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for g, summed in zip(bucket, unflatten_dense_tensors(flat, bucket)):
            g.copy_(summed)


def clip_grad_norm(module: nn.Module, max_norm: float, stage_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip `module`'s gradients (summed over its replicas already) by the norm of the whole model, and return it.

    Sharded gradients (FSDP) add their squares over the shards (`DTensor.full_tensor`); a pipeline stage's
    parameters are a part of the model: `stage_group` (the pp group) adds the stages' squares.
    """
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if stage_group is not None:
        squared = norm.pow(2)
        dist.all_reduce(squared, group=stage_group)
        norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm

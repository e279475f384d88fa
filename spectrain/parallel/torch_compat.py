"""Every private PyTorch internal spectrain.parallel touches, in one place, checked against the release
it was verified on.

The plans flatten gradients and weights into one buffer per dtype (`torch._utils`), fold two
mesh dims into one process group (`DeviceMesh._flatten`), and read a pipelining schedule's
microbatch count and action order (to post the draft's taps in the order the schedule runs
the forwards). Such internals move between torch releases, so each is looked up here; a
missing one raises a `TorchVersionError` naming the installed torch, the verified one and
the fix, instead of an AttributeError in the middle of a run. Everything else in
`spectrain.parallel` calls these functions.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from spectrain.errors import SpecTrainError
from spectrain.internals import Internals

VERIFIED_VERSION = "2.13.0"  # the torch release every function here was written and tested against


class TorchVersionError(SpecTrainError):
    """The installed torch lacks an internal spectrain.parallel relies on."""


_TORCH = Internals("torch", "torch", torch.__version__, VERIFIED_VERSION, "spectrain/parallel/torch_compat.py",
                   TorchVersionError)
internal, attribute = _TORCH.internal, _TORCH.attribute


# flat buffers -----------------------------------------------------------------------
def flatten_dense_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors (one dtype) back to back in one 1-D buffer: one collective instead of one each."""
    return internal("torch._utils", "_flatten_dense_tensors")(tensors)


def unflatten_dense_tensors(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `like` (the inverse of `flatten_dense_tensors`)."""
    return internal("torch._utils", "_unflatten_dense_tensors")(flat, like)


# meshes -----------------------------------------------------------------------------
def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The dims of `mesh` (a slice such as `mesh["dp", "cp"]`) folded into one dim `name`: one group over all
    of them."""
    return attribute(mesh, "_flatten", "DeviceMesh")(name)


# FSDP2 ------------------------------------------------------------------------------
def fsdp_param_dtype(unit) -> torch.dtype | None:
    """The `param_dtype` of the `MixedPrecisionPolicy` an FSDP2 unit was sharded with (None: its parameters')."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(unit)  # type: ignore[attr-defined]  # torch's @contract adds `state`, untyped
    return attribute(state, "_mp_policy", "FSDPState").param_dtype


# pipelining schedules ---------------------------------------------------------------
def schedule_microbatches(schedule) -> int:
    """The microbatch count a pipelining schedule was built with."""
    return attribute(schedule, "_n_microbatches", type(schedule).__name__)


def forward_actions(schedule, pp_rank: int) -> list[tuple[int, int]]:
    """`(stage, microbatch)` of each forward in a multi-stage schedule's action list for `pp_rank`, in order."""
    forward = attribute(internal("torch.distributed.pipelining.schedules", "_ComputationType"), "FORWARD",
                        "_ComputationType")
    actions = attribute(schedule, "pipeline_order", type(schedule).__name__)[pp_rank]
    return [(a.stage_index, a.microbatch_index) for a in actions
            if a is not None and a.computation_type == forward]

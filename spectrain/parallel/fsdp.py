"""Sharded data parallel (`parallel.fsdp=true`): FSDP2 `fully_shard` of the policy and the draft.

Applied after the plan's stage split (`shard_modules`; a pipeline stage, or the whole policy at
pp=1): each decoder layer of this rank's stage(s), then the rest of the stage (embeddings, final
norm, lm_head: the policy's root at pp=1), then the draft where it lives, as one unit (its forward
reaches into the midlayer's submodules, so a unit per midlayer would never see its own forward),
are sharded over ALL ranks holding the same stage: the dp x cp mesh flattened to ``dp_cp``
(torchtitan's ``dp_shard_cp``), not HSDP. Every one of those ranks computes a gradient share of
the same parameters, so one reduce-scatter over all of them is exactly the all-reduce the plan runs
unsharded, each rank keeps 1/(dp*cp) of its stage's weights and AdamW state instead of all of them,
and no second (replicate) collective is needed.

Gradients are SUMMED (every loss is already divided by the global token count): divide
factor 1 with sum-only collectives, which also suits gloo (no AVG / PREMUL_SUM there).
Mixed precision follows Lightning's precision: bf16 parameters for compute with float32
gradient reduction under ``bf16-mixed``; the parameters' own dtype otherwise.

Full tensors leave the shards one at a time: `DTensor.full_tensor()` is collective, so every
rank walks the same names in the same order and only the rank that needs them keeps the
result, on the CPU (weight sync: rank 0 holds the gathered model once, in host memory, and
never a second copy on the device; checkpoints: the full state dict on rank 0, in the same
format an unsharded run writes, so either kind of run resumes the other's checkpoint).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, overload

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from spectrain.models.llama import LlamaForCausalLM
from spectrain.parallel.torch_compat import fsdp_param_dtype

NamedTensors = list[tuple[str, torch.Tensor]]


def mixed_precision(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """bf16 compute with float32 reduction when `param_dtype` is bf16; the parameters' dtype throughout when None."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)


def sum_gradients(module: nn.Module) -> None:
    """Every FSDP unit in `module` sums its reduce-scatter (no 1/world averaging, SUM ops only)."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)


def shard_stage(stage: Any, mesh, mp: MixedPrecisionPolicy,
                root_reshard_after_forward: bool | None = None) -> None:
    """One FSDP unit per decoder layer of `stage` (gathered just before it runs, freed after), then the rest (None:
    FSDP's default for a root, kept gathered from its forward to its backward).

    `stage` is the whole policy (pp=1: the rest is the policy itself, the root) or a pipeline stage: then each of
    its embeddings, final norm and lm_head is a unit of its own (the runner's stage objects are rebuilt per
    microbatch budget, so the units are the modules they share, and FSDP runs one root module per unit).
    """
    for layer in stage.model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    rest = [stage] if isinstance(stage, LlamaForCausalLM) else [
        m for m in (getattr(stage.model, "embed_tokens", None), getattr(stage.model, "norm", None),
                    getattr(stage, "lm_head", None)) if m is not None]
    for module in rest:
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=root_reshard_after_forward)


def shard_modules(plan, policy: nn.Module, draft: nn.Module | None = None, reference: nn.Module | None = None,
                  param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 over `plan.replica_mesh` (the dp x cp ranks holding the same stage), applied after the plan's stage
    split: each of this rank's `plan.stages(policy)`, the KL `reference`'s likewise (frozen; only pp=1 has one),
    and the `draft` where it lives. In place; build the optimizers afterwards.

    Gradients are summed in the reduce-scatter, so the plan's `reduce_gradients` leaves sharded ones alone.
    """
    mp = mixed_precision(param_dtype)
    for stage in plan.stages(policy):
        shard_stage(stage, plan.replica_mesh, mp)
    sum_gradients(policy)
    if reference is not None:
        reference.requires_grad_(False)
        for stage in plan.stages(reference):
            # only ever run under no_grad: no backward comes to free a gathered root, so it reshards after forward
            shard_stage(stage, plan.replica_mesh, mp, root_reshard_after_forward=True)
    if draft is not None and plan.hosts_draft:
        # its forward reaches into the midlayer's submodules: one unit, so no unit misses its own forward
        fully_shard(draft, mesh=plan.replica_mesh, mp_policy=mp)
        sum_gradients(draft)


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype `module`'s activations come in: its first FSDP unit's mixed-precision parameter dtype where one
    is set (bf16 under Lightning's bf16-mixed), else its first parameter's."""
    unit = next((m for m in module.modules() if isinstance(m, FSDPModule)), None)
    return (unit is not None and fsdp_param_dtype(unit)) or next(module.parameters()).dtype


def is_sharded(module: nn.Module | None) -> bool:
    """Whether any part of `module` is sharded (under pp, only this rank's stage of the policy is)."""
    return module is not None and any(isinstance(m, FSDPModule) for m in module.modules())


@overload
def full_tensor(t: torch.Tensor, keep: Literal[True]) -> torch.Tensor: ...


@overload
def full_tensor(t: torch.Tensor, keep: bool) -> torch.Tensor | None: ...


def full_tensor(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """`t` whole where `keep`: a DTensor gathered onto the CPU (collective: every rank of its mesh must call it),
    a plain tensor as it is (detached, no copy)."""
    if not isinstance(t, DTensor):
        return t.detach() if keep else None
    full = t.full_tensor()
    return full.detach().cpu() if keep else None


def gathered(named: Iterable[tuple[str, torch.Tensor]], keep: bool) -> NamedTensors | None:
    """Each tensor gathered in turn, in `named`'s order; the list where `keep`, None elsewhere."""
    out = [(name, full_tensor(t, keep)) for name, t in named]  # every rank joins every gather
    return [(name, t) for name, t in out if t is not None] if keep else None


def gathered_state_dict(module: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with full tensors, on the CPU, where `keep`; empty elsewhere (collective)."""
    return dict(gathered(module.state_dict().items(), keep) or ())


def gathered_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool) -> dict:
    """`optimizer.state_dict()` with full tensors where `keep` (the unsharded format); empty elsewhere (collective)."""
    sd = optimizer.state_dict()
    state = {index: dict(gathered(sd["state"][index].items(), keep) or ()) for index in sorted(sd["state"])}
    return {"state": state, "param_groups": sd["param_groups"]} if keep else {}


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Cut full-size state (loaded from a checkpoint or the draft warm-up) into each sharded parameter's shard.

    No communication: every rank holds the same full tensors and keeps its own chunk. State
    that is not parameter-shaped (AdamW's step) stays as it is.
    """
    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                state[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                               src_data_rank=None)


def unsharded_copy(module: nn.Module | None, keep: bool) -> nn.Module | None:
    """A plain copy of a sharded `module` (its class rebuilt from its `cfg`, the gathered weights loaded) where
    `keep`, for writing it out; an unsharded module as it is. Collective when sharded."""
    if module is None or not is_sharded(module):
        return module
    state = gathered_state_dict(module, keep)
    if not keep:
        return None
    copy = type(module)(module.cfg)
    copy.load_state_dict(state, assign=True)  # the gathered tensors themselves, in their dtype
    return copy

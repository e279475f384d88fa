"""Sharded data parallel (`parallel.fsdp=true`): FSDP2 `fully_shard` of the policy and the draft.

Each decoder layer, then the policy's root (embeddings, final norm, lm_head), then the draft
as one unit (its forward reaches into the midlayer's submodules, so a unit per midlayer
would never see its own forward) are sharded over ALL data-holding ranks: the dp x cp
mesh flattened to ``dp_cp`` (torchtitan's ``dp_shard_cp``), not HSDP. Every one of those
ranks computes a gradient share of the same parameters, so one reduce-scatter over all of
them is exactly the all-reduce `ContextParallelPlan` runs today, each rank keeps
1/(dp*cp) of the weights and AdamW state instead of 1/dp, and no second (replicate)
collective is needed.

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

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from spectrain.parallel.cp.plan import ContextParallelPlan
from spectrain.parallel.plan import LocalPlan

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


def _shard_layers_then_root(model: nn.Module, mesh, mp: MixedPrecisionPolicy,
                            root_reshard_after_forward: bool | None = None) -> None:
    """One FSDP unit per decoder layer (gathered just before it runs, freed after), then the root (None: FSDP's
    default for a root, kept gathered from its forward to its backward)."""
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=root_reshard_after_forward)


def shard_policy(policy: nn.Module, mesh, mp: MixedPrecisionPolicy) -> None:
    _shard_layers_then_root(policy, mesh, mp)
    sum_gradients(policy)


def shard_reference(reference: nn.Module, mesh, mp: MixedPrecisionPolicy) -> None:
    """The frozen KL reference sharded like the policy (1/N of its weights per rank, no gradients, no optimizer).

    It only ever runs under no_grad, so no backward comes to free the gathered root (embeddings,
    lm_head): the root reshards after its forward too, unlike the policy's.
    """
    reference.requires_grad_(False)
    _shard_layers_then_root(reference, mesh, mp, root_reshard_after_forward=True)


def shard_draft(draft: nn.Module, mesh, mp: MixedPrecisionPolicy) -> None:
    fully_shard(draft, mesh=mesh, mp_policy=mp)
    sum_gradients(draft)


def is_sharded(module: nn.Module | None) -> bool:
    return isinstance(module, FSDPModule)


def full_tensor(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """`t` whole, on the CPU, where `keep`; collective for a DTensor (every rank must call it), else local."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.detach().cpu() if keep else None


def gathered(named: Iterable[tuple[str, torch.Tensor]], keep: bool) -> NamedTensors | None:
    """Each tensor gathered in turn, in `named`'s order; the list where `keep`, None elsewhere."""
    out = [(name, full_tensor(t, keep)) for name, t in named]
    return out if keep else None


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
    if not is_sharded(module):
        return module
    state = gathered_state_dict(module, keep)
    if not keep:
        return None
    copy = type(module)(module.cfg)
    copy.load_state_dict(state, assign=True)  # the gathered tensors themselves, in their dtype
    return copy


class FullyShardedPlan(ContextParallelPlan):
    """`ContextParallelPlan` whose policy and draft are sharded over the flattened dp x cp ranks.

    The step is the CP plan's (dp slices, zigzag shards, ring attention); FSDP gathers each
    unit's weights for its forward and backward and reduce-scatters the summed gradients,
    so `reduce_gradients` has nothing left to do for a sharded module. `prepare` (rank 0's
    weights everywhere) runs before `shard_modules`, on whole tensors.
    """

    def shard_modules(self, module: nn.Module, param_dtype: torch.dtype | None = None) -> None:
        """Shard `module.policy`, the KL `module.reference` (when there is one) and `module.draft` in place;
        build their optimizers afterwards."""
        mp = mixed_precision(param_dtype)
        shard_policy(module.policy, self.replica_mesh, mp)
        if getattr(module, "reference", None) is not None:
            shard_reference(module.reference, self.replica_mesh, mp)
        if module.draft is not None:
            shard_draft(module.draft, self.replica_mesh, mp)

    def reduce_gradients(self, module: nn.Module) -> None:
        if not is_sharded(module):
            super().reduce_gradients(module)

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        """torch's clip over DTensor gradients: the norm is reduced over the shards, i.e. the global one."""
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def policy_weights(self, policy, everywhere: bool = False) -> NamedTensors | None:
        """The policy gathered tensor by tensor, kept on rank 0 (`everywhere`: on every rank, for its engine); the
        other ranks drive the same all-gathers."""
        return gathered(LocalPlan().policy_weights(policy), keep=self.is_rollout_rank or everywhere)

    def draft_weights(self, draft, everywhere: bool = False) -> NamedTensors | None:
        return gathered(LocalPlan().draft_weights(draft), keep=self.is_rollout_rank or everywhere)

"""`ContextParallelPlan`: the GRPO step over a dp x cp mesh (pp = 1).

Every rank holds the whole rollout and a full replica of the policy and the draft. A dp
rank takes a contiguous slice of the documents; inside its cp group each document is cut
into the zigzag layout (``spectrain.parallel.cp.zigzag``), the policy runs with ring attention
on its local shard, and the draft trains on the taps of that same forward, with the ring
for its causal trunk and the boundary-exchanging shift for ``x_{i+d}``. Every loss is
divided by a global count that each rank computes from the whole rollout, so summing the
gradients over all dp x cp ranks gives exactly the single-process gradients.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from spectrain.batch import RolloutBatch, concat_batches, micro_batches
from spectrain.models.llama import LlamaForCausalLM
from spectrain.parallel.cp.ring import ZigzagRingAttentionOps
from spectrain.parallel.cp.zigzag import ZigzagLayout, shard, shift_left
from spectrain.parallel.fsdp import gathered
from spectrain.parallel.mesh import MESH_DIMS, ROLLOUT_RANK, all_reduce_gradients, clip_grad_norm
from spectrain.parallel.plan import LocalPlan, PolicyUpdateResult, ShiftFn, micro_batch_forward_backward
from spectrain.parallel.torch_compat import flatten_mesh


def check_cp_attention_ops(ops) -> None:
    """Fail before any work when `ops` cannot be the block backend of ring attention.

    Each ring step calls ``ops.forward(q, k, v, cu_q, cu_k, causal=False, scale)`` with
    unequal q/k lengths and ``ops.backward(..., out, lse, ...)`` with the *joint* statistics
    (docs/dev/contracts.md). A backend that cannot do that (e.g. a causal-only kernel)
    declares ``supports_context_parallel = False``.
    """
    name = type(ops).__name__
    if isinstance(ops, ZigzagRingAttentionOps):
        reason = "it is already ring attention; keep the local ops on the policy, the plan wraps them each step"
    elif not (callable(getattr(ops, "forward", None)) and callable(getattr(ops, "backward", None))):
        reason = "it has no forward(q, k, v, cu_q, cu_k, causal, scale) -> (out, lse) / backward(...) pair"
    elif getattr(ops, "supports_context_parallel", True) is False:
        reason = "it declares supports_context_parallel = False"
    else:
        return
    raise TypeError(
        f"context parallelism cannot run on policy.attention_ops = {name}: {reason}. Ring attention needs "
        f"non-causal varlen blocks with an lse and a backward from the joint (out, lse); use LocalAttentionOps "
        f"(spectrain.ops.attention) or a flash backend that has both, or train with parallel.cp=1")


def dp_documents(num_docs: int, dp_size: int, dp_rank: int) -> list[int]:
    """This dp rank's contiguous, near-equal share of the documents (groups stay mostly together)."""
    if num_docs < dp_size:
        raise ValueError(f"a batch of {num_docs} documents cannot be split over parallel.dp={dp_size} ranks; "
                         f"raise rollout.prompts_per_step x rollout.n or lower parallel.dp")
    return torch.tensor_split(torch.arange(num_docs), dp_size)[dp_rank].tolist()


def shard_batch(batch: RolloutBatch, layout: ZigzagLayout, pad_id: int) -> RolloutBatch:
    """This cp rank's zigzag shard of a packed batch; pad rows never count (target -1, mask False)."""
    assert batch.input_ids.shape == (layout.num_global_tokens,), (batch.input_ids.shape, layout.num_global_tokens)
    local = RolloutBatch(
        input_ids=shard(batch.input_ids, layout, pad_id),
        position_ids=layout.position_ids,  # in-document positions, continuous across the two chunks
        cu_seqlens=layout.cu_seqlens_local,
        targets=shard(batch.targets, layout, -1),
        response_mask=shard(batch.response_mask, layout, False),
        advantages=shard(batch.advantages, layout, 0.0),
        rollout_logprobs=shard(batch.rollout_logprobs, layout, 0.0),
        # the whole document's, not the shard's
        response_lengths=None if batch.response_lengths is None else shard(batch.response_lengths, layout, 0.0),
    )
    assert torch.equal(shard(batch.position_ids, layout, 0)[layout.valid], layout.position_ids[layout.valid]), (
        "batch.position_ids must count from 0 inside every document")
    return local


def zigzag_shift_fn(layout: ZigzagLayout, group: dist.ProcessGroup) -> ShiftFn:
    """`shift_fn` of `Eagle3Draft.forward` / `ttt_loss` on this layout's shards."""

    def shift_fn(x: torch.Tensor, cu_seqlens: torch.Tensor, shift: int, fill: float) -> torch.Tensor:
        assert torch.equal(cu_seqlens, layout.cu_seqlens_local), "shift_fn called on another batch's shards"
        return shift_left(x, layout, shift, group, fill)

    return shift_fn


class ContextParallelPlan:
    """dp x cp, every rank a full replica; rank 0 shares what every rank must agree on."""

    hosts_draft = True  # each rank trains its draft replica on its shard; gradients are summed

    def __init__(self, mesh: DeviceMesh) -> None:
        assert mesh.mesh_dim_names == MESH_DIMS, mesh.mesh_dim_names
        if mesh["pp"].size() != 1:
            raise ValueError(f"ContextParallelPlan covers dp x cp only; pp={mesh['pp'].size()} needs the pipeline plan")
        self.mesh = mesh
        self.dp_size, self.dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        self.cp_size, self.cp_rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
        self.cp_group = mesh["cp"].get_group()
        self.replica_mesh = flatten_mesh(mesh["dp", "cp"], "dp_cp")  # all ranks holding a replica (or a shard)
        self.replica_group = self.replica_mesh.get_group()
        self.is_rollout_rank = dist.get_rank() == ROLLOUT_RANK

    def prepare(self, module: Any) -> None:  # the LightningModule (its policy)
        """Before any work: the policy's ops can run under CP, and every replica starts from rank 0's weights."""
        check_cp_attention_ops(module.policy.attention_ops)
        with torch.no_grad():
            for t in module.state_dict().values():
                dist.broadcast(t, src=ROLLOUT_RANK, group=self.replica_group)

    def share(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=ROLLOUT_RANK, group=self.replica_group)
        return box[0]

    def shard(self, part: RolloutBatch, policy: LlamaForCausalLM) -> tuple[RolloutBatch, ZigzagLayout]:
        """This rank's zigzag shard of `part` (documents of its dp slice) over the cp group."""
        layout = ZigzagLayout.build(part.cu_seqlens, self.cp_size, self.cp_rank,
                                    max_seqlen=policy.cfg.max_position_embeddings)
        return shard_batch(part, layout, policy.cfg.pad_token_id), layout

    def policy_forward_backward(self, policy, batch, loss_fn, tap_layers, backward, on_taps=None,
                                micro_batch_tokens=None, teacher_t2d=None) -> PolicyUpdateResult:
        """This rank's dp slice in micro-batches of whole documents, each zigzag-sharded: the cp ranks of a group
        cut the same documents, so their rings line up; `micro_batch_tokens` is per rank (a micro-batch holds up
        to `cp` times as many tokens)."""
        part = batch.select(dp_documents(batch.num_docs, self.dp_size, self.dp_rank))
        budget = None if micro_batch_tokens is None else micro_batch_tokens * self.cp_size
        losses, logprobs, shards = [], [], []
        for mb in micro_batches(part, budget):
            local, layout = self.shard(mb, policy)
            ops = ZigzagRingAttentionOps(self.cp_group, local_ops=policy.attention_ops)
            local_ops, policy.attention_ops = policy.attention_ops, ops  # autograd keeps `ops` for the backward
            try:
                loss, lp = micro_batch_forward_backward(policy, local, loss_fn, tap_layers, backward, on_taps, ops,
                                                        zigzag_shift_fn(layout, self.cp_group), teacher_t2d)
            finally:
                policy.attention_ops = local_ops
            losses.append(loss)
            logprobs.append(lp)
            shards.append(local)
        update_loss = torch.stack(losses).sum()  # the shares add up to the step's loss: log that, not rank 0's share
        dist.all_reduce(update_loss, group=self.replica_group)
        return PolicyUpdateResult(update_loss, torch.cat(logprobs), concat_batches(shards, part))

    def stages(self, policy: LlamaForCausalLM) -> list[nn.Module]:
        """What this rank runs of the policy, for sharding: all of it (`fsdp.shard_modules`)."""
        return [policy]

    def reduce_gradients(self, module: nn.Module) -> None:
        """Sum gradients over all replicas (every rank runs the same graph: the same parameters have them)."""
        all_reduce_gradients(module, self.replica_group)

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        # gradients are identical on every replica after reduce_gradients (or sharded): the norm is the global one
        return clip_grad_norm(module, max_norm)

    def policy_weights(self, policy, everywhere: bool = False):
        """The policy's tensors on rank 0 (on every rank with `everywhere`, for its engine), None elsewhere; gathered
        tensor by tensor where sharded (every rank drives the same all-gathers)."""
        return gathered(LocalPlan().policy_weights(policy), keep=self.is_rollout_rank or everywhere)

    def draft_weights(self, draft, everywhere: bool = False):
        return gathered(LocalPlan().draft_weights(draft), keep=self.is_rollout_rank or everywhere)

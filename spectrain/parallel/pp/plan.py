"""`PipelinePlan`: the GRPO step over a pp x dp x cp mesh (pp > 1).

Every rank builds the same full policy and draft (same seed and warm start; `prepare`
makes them rank 0's) and runs only its pipeline stage(s) of the policy (`split_policy`
shares the parameters and keeps HF names). A step:

- dp: this rank's dp slice of the rollout's documents (`dp_documents`, as under CP);
- cp: the slice's documents enter the pipeline at their zigzag-shard lengths and each
  microbatch is this cp rank's zigzag shard of its documents; the stage's attention runs
  as ring attention over the cp group (all cp ranks of a stage run the same schedule, so
  their ring exchanges line up);
- pp: `PipelineRunner` cuts the part into `n_microbatches` packed microbatches, runs the
  schedule unchanged, and on the last stage calls the GRPO loss per microbatch (each is
  already normalised by the global token count, so the sum is the step loss). The draft's
  taps travel from earlier stages over the `TapChannel`; when the schedule ends, the last
  stage hands one `DraftInputs` per microbatch to `on_taps` (`DraftCoTraining` runs there
  only). None may be a view of a pipelining buffer, which the next `schedule.step()` refills:
  the taps are the channel's copies, the teacher logits come out of the stage's forward, the
  batch out of `select`.
- `grpo.micro_batch_tokens`: the part runs in rounds of `n_microbatches` microbatches of at
  most that many tokens each (`pipeline_rounds`), one schedule per round; gradients accumulate.

Gradients are summed over the stage's dp x cp replicas; the clip norm is the global one
(squared norms summed over the pp group). Weight sync gathers every stage (and the draft,
which lives on the last stage) to global rank 0, the rollout rank; rank 0 receives them
into its own full policy and draft, so its export and checkpoints hold the trained model.

Microbatch budget. Pipelining's buffers have static shapes, so a runner is built per token
budget: the smallest multiple of `TOKEN_MULTIPLE` into which the step's documents pack
(`microbatch_budget`). Rounding bounds both the padding (under `TOKEN_MULTIPLE` tokens per
microbatch beyond the tightest fit) and the number of runners kept.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from spectrain.batch import RolloutBatch, concat_batches
from spectrain.config.schema import PP_STAGES_PER_RANK
from spectrain.models.llama import CausalLMOutput, LlamaConfig, LlamaForCausalLM
from spectrain.ops.chunked_logprobs import dense_token_logprobs
from spectrain.parallel.cp.plan import (
    check_cp_attention_ops,
    dp_documents,
    shard_batch,
    zigzag_shift_fn,
)
from spectrain.parallel.cp.ring import ZigzagRingAttentionOps
from spectrain.parallel.cp.zigzag import ZigzagLayout
from spectrain.parallel.fsdp import full_tensor, gathered, is_sharded
from spectrain.parallel.mesh import MESH_DIMS, ROLLOUT_RANK, all_reduce_gradients, by_dtype, clip_grad_norm
from spectrain.parallel.plan import (
    UNSET_NORMALISER,
    LocalPlan,
    PolicyLossFn,
    PolicyUpdateResult,
    draft_inputs_from,
)
from spectrain.parallel.pp.runner import PipelineRunner, make_tap_channel, split_microbatches
from spectrain.parallel.pp.stages import local_stage_indices, split_policy
from spectrain.parallel.pp.tap_channel import TapChannel, new_tap_group
from spectrain.parallel.torch_compat import flatten_dense_tensors, flatten_mesh, unflatten_dense_tensors

TOKEN_MULTIPLE = 64


def pipeline_rounds(part: RolloutBatch, n_microbatches: int, micro_batch_tokens: int | None,
                    cp_size: int) -> list[RolloutBatch]:
    """`part` in the fewest contiguous rounds whose documents pack into `n_microbatches` microbatches of at most
    `micro_batch_tokens` tokens each (per rank: zigzag shards hold 1/cp of a document); None: one round.

    Each round is one run of the schedule, so the pipeline's shapes stay static; gradients accumulate over rounds.
    """
    if micro_batch_tokens is None:
        return [part]
    lengths = part.cu_seqlens[1:] - part.cu_seqlens[:-1]
    if cp_size > 1:  # a zigzag shard: the document padded to 2*cp chunks, two of them per rank
        lengths = -(-lengths // (2 * cp_size)) * 2
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    for rounds in range(1, part.num_docs // n_microbatches + 1):
        splits = torch.tensor_split(torch.arange(part.num_docs), rounds)
        try:
            for docs in splits:
                split_microbatches(cu[docs[0]:docs[-1] + 2] - cu[docs[0]], n_microbatches, micro_batch_tokens)
        except ValueError:
            continue
        return [part.select(d.tolist()) for d in splits]
    raise ValueError(f"grpo.micro_batch_tokens={micro_batch_tokens}: this rank's {part.num_docs} documents do not "
                     f"pack into rounds of parallel.microbatches={n_microbatches} microbatches of that many tokens; "
                     f"raise grpo.micro_batch_tokens or lower parallel.microbatches")


def microbatch_budget(cu_seqlens: torch.Tensor, n_microbatches: int, multiple: int = TOKEN_MULTIPLE) -> int:
    """Smallest multiple of `multiple` tokens that packs the documents into `n_microbatches` microbatches.

    `split_microbatches` (greedy, the fewest contiguous groups) decides what fits; fitting is
    monotone in the budget, so a bisection over multiples finds the smallest.
    """
    lengths = cu_seqlens.diff()
    total = int(lengths.sum())
    hi = -(-total // multiple)
    split_microbatches(cu_seqlens, n_microbatches, hi * multiple)  # raises when nothing fits (too few documents)
    lo = -(-max(int(lengths.max()), -(-total // n_microbatches)) // multiple)
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            split_microbatches(cu_seqlens, n_microbatches, mid * multiple)
            hi = mid
        except ValueError:
            lo = mid + 1
    return hi * multiple


class ZigzagDocs:
    """A dp part as the runner sees it under CP: documents at their zigzag-shard lengths.

    `select(docs)` is this cp rank's shard of those documents; `layouts` keeps each shard's
    layout (by shard identity) for the draft's boundary-exchanging shift.
    """

    def __init__(self, part: RolloutBatch, cp_size: int, cp_rank: int, cfg: LlamaConfig) -> None:
        self.part, self.cp_size, self.cp_rank, self.cfg = part, cp_size, cp_rank, cfg
        self.cu_seqlens = self._layout(part).cu_seqlens_local
        self.layouts: dict[int, ZigzagLayout] = {}

    def _layout(self, batch: RolloutBatch) -> ZigzagLayout:
        return ZigzagLayout.build(batch.cu_seqlens, self.cp_size, self.cp_rank,
                                  max_seqlen=self.cfg.max_position_embeddings)

    def select(self, docs: list[int]) -> RolloutBatch:
        sub = self.part.select(docs)
        layout = self._layout(sub)
        local = shard_batch(sub, layout, self.cfg.pad_token_id)
        self.layouts[id(local)] = layout
        return local


def _send(tensors: list[torch.Tensor], group: dist.ProcessGroup, dst: int) -> None:
    for bucket in by_dtype(tensors):
        dist.send(flatten_dense_tensors(bucket), group=group, group_dst=dst)


def _broadcast_into(tensors: list[torch.Tensor], src: int) -> None:
    """Rank `src`'s values of the same tensor list into every rank's `tensors`, in place (one bucket per dtype)."""
    with torch.no_grad():
        for bucket in by_dtype(tensors):
            flat = flatten_dense_tensors(bucket)
            dist.broadcast(flat, src=src)
            for t, got in zip(bucket, unflatten_dense_tensors(flat, bucket)):
                t.copy_(got)


def _recv_into(tensors: list[torch.Tensor], group: dist.ProcessGroup, src: int) -> None:
    """Receive what `_send` sent from the same tensor list into `tensors`, in place."""
    for bucket in by_dtype(tensors):
        flat = flatten_dense_tensors(bucket)
        dist.recv(flat, group=group, group_src=src)
        for t, got in zip(bucket, unflatten_dense_tensors(flat, bucket)):
            t.copy_(got)


class PipelinePlan:
    """pp x dp x cp: each rank runs its stage(s); the draft and its loss live on the last stage.

    Args:
        mesh: the run's ("pp", "dp", "cp") mesh, pp >= 2.
        schedule_name: "GPipe", "1F1B" or "Interleaved1F1B" (2 stages per rank).
        n_microbatches: microbatches per step (per dp rank); 1F1B needs >= the stage count.
        tap_transport: `TapChannel`, or `BlockingTapTransport` (the benchmark's baseline).
    """

    def __init__(self, mesh: DeviceMesh, schedule_name: str, n_microbatches: int,
                 tap_transport: type[TapChannel] = TapChannel) -> None:
        assert mesh.mesh_dim_names == MESH_DIMS, mesh.mesh_dim_names
        if schedule_name not in PP_STAGES_PER_RANK:
            raise ValueError(f"unknown pipeline schedule {schedule_name!r}: set parallel.pp_schedule to one of "
                             f"{sorted(PP_STAGES_PER_RANK)}")
        self.pp_size, self.pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
        if self.pp_size < 2:
            raise ValueError("PipelinePlan needs parallel.pp >= 2; pp=1 runs ContextParallelPlan")
        self.dp_size, self.dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        self.cp_size, self.cp_rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
        self.schedule_name, self.n_microbatches, self.tap_transport = schedule_name, n_microbatches, tap_transport
        self.stages_per_rank = PP_STAGES_PER_RANK[schedule_name]
        self.num_stages = self.pp_size * self.stages_per_rank
        self.pp_group = mesh["pp"].get_group()
        self.cp_group = mesh["cp"].get_group()
        self.replica_mesh = flatten_mesh(mesh["dp", "cp"], "dp_cp")  # the copies of this stage (FSDP shards over it)
        self.tap_group = new_tap_group(self.pp_group)
        self.is_rollout_rank = dist.get_rank() == ROLLOUT_RANK
        self.last_stage_rank = (self.num_stages - 1) % self.pp_size
        self.hosts_draft = self.pp_rank == self.last_stage_rank
        # the stage copies in rank 0's pp group send weights to rank 0 (every copy holds the same ones)
        self.gathers_weights = self.dp_rank == 0 and self.cp_rank == 0
        assert self.is_rollout_rank == (self.gathers_weights and self.pp_rank == 0), "rank 0 must be mesh (0, 0, 0)"
        self._policy: LlamaForCausalLM | None = None
        self._runners: dict[tuple[tuple[int, ...], int], PipelineRunner] = {}
        self._loss_fn: PolicyLossFn | None = None
        self._outputs: list[tuple[CausalLMOutput, RolloutBatch, torch.Tensor]] = []

    def prepare(self, module: Any) -> None:  # the LightningModule (its policy)
        """Before any work: CP-capable attention ops, and every rank starts from rank 0's weights."""
        if self.cp_size > 1:
            check_cp_attention_ops(module.policy.attention_ops)
        with torch.no_grad():
            for t in module.state_dict().values():
                dist.broadcast(t, src=ROLLOUT_RANK)

    def share(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=ROLLOUT_RANK)
        return box[0]

    # the step ------------------------------------------------------------------------------
    def _local_stage_indices(self) -> list[int]:
        return local_stage_indices(self.pp_rank, self.pp_size, self.stages_per_rank)

    def stages(self, policy: LlamaForCausalLM) -> list[nn.Module]:
        """This rank's stage(s) of the policy, for sharding (`fsdp.shard_modules`)."""
        return [split_policy(policy, self.num_stages, s) for s in self._local_stage_indices()]

    def _runner(self, policy: LlamaForCausalLM, tap_layers: tuple[int, ...], budget: int) -> PipelineRunner:
        """The runner of this budget; fresh stages each, since a runner points its stages' taps at its channel."""
        if policy is not self._policy:
            self._policy, self._runners = policy, {}
        key = (tap_layers, budget)
        if key not in self._runners:
            stages = [split_policy(policy, self.num_stages, s, tap_layers) for s in self._local_stage_indices()]
            if self.cp_size > 1:
                for s in stages:
                    s.attention_ops = ZigzagRingAttentionOps(self.cp_group, local_ops=policy.attention_ops)
            channel = (make_tap_channel(stages[0], self.tap_group, budget, self.tap_transport)
                       if tap_layers else None)
            self._runners[key] = PipelineRunner(stages, self.schedule_name, self.n_microbatches, budget,
                                                self._microbatch_loss, self.pp_group, channel)
        return self._runners[key]

    def _microbatch_loss(self, out: CausalLMOutput, mb: RolloutBatch) -> torch.Tensor:
        assert self._loss_fn is not None and out.logits is not None, "the last stage's loss, inside a step"
        loss, logprobs = self._loss_fn(dense_token_logprobs(out.logits, mb.targets), mb)
        self._outputs.append((out, mb, logprobs.detach()))
        return loss

    def policy_forward_backward(self, policy, batch, loss_fn, tap_layers, backward, on_taps=None,
                                micro_batch_tokens=None, teacher_t2d=None) -> PolicyUpdateResult:
        """The pipelined forward and backward of this rank's part of `batch`.

        Without `micro_batch_tokens` the part runs as one schedule of `n_microbatches` microbatches;
        with it, in rounds of `n_microbatches` microbatches of at most that many tokens each
        (`pipeline_rounds`). Each round's taps go to `on_taps` (on the last stage) when it ends. The last
        stage still computes each microbatch's [T, V] logits (its lm_head is a stage module): the logprobs
        and the teacher come from them, and `teacher_t2d` is not used.
        `backward` is not used: the schedule runs each microbatch's backward itself (so
        Lightning's precision scaling does not apply; fine for fp32 and bf16-true).
        """
        part = batch.select(dp_documents(batch.num_docs, self.dp_size, self.dp_rank))
        losses, logprobs, shards = [], [], []
        for docs in pipeline_rounds(part, self.n_microbatches, micro_batch_tokens, self.cp_size):
            round_losses, outputs, docs = self._round(policy, docs, loss_fn, tuple(tap_layers), micro_batch_tokens)
            losses += round_losses
            for out, mb, lp in outputs:
                if tap_layers:
                    shift_fn = None if self.cp_size == 1 else zigzag_shift_fn(docs.layouts[id(mb)], self.cp_group)
                    on_taps(draft_inputs_from(out, mb, self._ops, shift_fn, UNSET_NORMALISER))
                logprobs.append(lp)
                shards.append(mb)
        # the last stages' shares add up to the step's loss: log that everywhere (float64: one dtype on every rank)
        update_loss = torch.stack(losses).sum().double() if losses else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(update_loss)
        return PolicyUpdateResult(update_loss, torch.cat(logprobs) if logprobs else torch.zeros(0),
                                  concat_batches(shards, part))

    def _round(self, policy, part: RolloutBatch, loss_fn, tap_layers: tuple[int, ...], micro_batch_tokens):
        """One schedule over `part`: the last stage's losses and (output, microbatch, logprobs), and the docs."""
        docs = part if self.cp_size == 1 else ZigzagDocs(part, self.cp_size, self.cp_rank, policy.cfg)
        budget = microbatch_budget(docs.cu_seqlens, self.n_microbatches)
        assert micro_batch_tokens is None or budget <= -(-micro_batch_tokens // TOKEN_MULTIPLE) * TOKEN_MULTIPLE, (
            budget, micro_batch_tokens)
        runner = self._runner(policy, tap_layers, budget)
        self._loss_fn, self._outputs, self._ops = loss_fn, [], runner.stages[-1].attention_ops
        try:
            losses = runner.step(docs)
            outputs = self._outputs
        finally:
            self._loss_fn, self._outputs = None, []
        assert (losses is not None) == runner.has_last and len(outputs) == len(losses or ()), "one loss per microbatch"
        return list(losses or ()), outputs, docs

    def reduce_gradients(self, module: nn.Module) -> None:
        """Sum the gradients over the copies of this rank's stage(s) (its dp x cp group)."""
        all_reduce_gradients(module, self.replica_mesh.get_group())

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole policy: squared stage norms summed over the pp group.

        Only this rank's stage parameters have gradients; after `reduce_gradients` they are the
        same on every copy of the stage (or its shards add up over them), so each pp group computes
        the same global norm.
        """
        return clip_grad_norm(module, max_norm, self.pp_group)

    # weight sync -----------------------------------------------------------------------------
    def policy_weights(self, policy, everywhere: bool = False):
        """Every stage's weights, gathered into rank 0's full policy; its HF-named list there, None elsewhere
        (`everywhere`: rank 0's list is then broadcast into every rank's). Sharded stages are gathered tensor by
        tensor, collectively over their copies (rank 0's own stage on the CPU, as at pp=1)."""
        self._gather_policy(policy)
        if not (self.pp_rank == 0 or everywhere):
            return None
        named = gathered(LocalPlan().policy_weights(policy), keep=self.is_rollout_rank or everywhere)
        if everywhere:  # one device on every rank for the broadcast (a no-op unsharded: into the policy itself)
            assert named is not None
            device = next(policy.parameters()).device
            named = [(n, t.to(device)) for n, t in named]
            _broadcast_into([t for _, t in named], ROLLOUT_RANK)
        return named

    def _gather_policy(self, policy) -> None:
        """The other stages' weights into rank 0's policy, sent by the first copy of each stage (whose copies
        gather a sharded stage first)."""
        stage = lambda s: split_policy(policy, self.num_stages, s).state_dict()  # noqa: E731
        if self.pp_rank != 0:
            device = next(policy.parameters()).device
            for s in self._local_stage_indices():
                full = gathered(stage(s).items(), keep=self.gathers_weights)
                if full is not None:
                    _send([t.to(device) for _, t in full], self.pp_group, 0)
        elif self.is_rollout_rank:
            with torch.no_grad():
                for s in range(self.num_stages):
                    if s % self.pp_size:
                        _recv_into(list(stage(s).values()), self.pp_group, s % self.pp_size)

    def draft_weights(self, draft, everywhere: bool = False):
        """The last stage's draft (gathered over its copies where sharded), received into rank 0's draft; its sync
        weights there, None elsewhere (`everywhere`: broadcast from rank 0 into every rank's draft)."""
        tensors = list(draft.state_dict().values())
        sharded = self.hosts_draft and is_sharded(draft)
        if sharded:
            tensors = [full_tensor(t, keep=True).to(t.device) for t in tensors]
        if self.gathers_weights and self.pp_rank == self.last_stage_rank:
            _send(tensors, self.pp_group, 0)
        elif self.is_rollout_rank:
            with torch.no_grad():
                _recv_into(tensors, self.pp_group, self.last_stage_rank)
        if everywhere:
            _broadcast_into(tensors, ROLLOUT_RANK)
        if not (self.is_rollout_rank or everywhere):
            return None
        return gathered(LocalPlan().draft_weights(draft), keep=True) if sharded else LocalPlan().draft_weights(draft)

"""How one GRPO step is laid out over ranks: the seam between the module and the parallelisms.

`GRPOModule` runs the same step everywhere: the rollout rank generates, `share` hands the
rollout to every rank, `policy_forward_backward` runs the policy over this rank's part of
the batch (whole batch; a dp slice; zigzag shards under CP; pipeline microbatches under
PP) in micro-batches of at most `micro_batch_tokens` tokens, accumulating gradients, and
hands each micro-batch's `DraftInputs` to `on_taps` right after its forward (so no taps or
teacher logits outlive their micro-batch); `reduce_gradients` makes the gradients the
single-process ones. Every rank holds the whole rollout, so global token counts (the loss
normalisers) are computed locally and need no communication.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch
from torch import nn

from spectrain.batch import RolloutBatch, concat_batches, micro_batches
from spectrain.models.llama import CausalLMOutput, LlamaForCausalLM

# (logprobs [T] of this rank's targets (float32, differentiable; computed from the lm_head in chunks, never as
# [T, V] logits), the matching batch part) -> (this part's share of the global loss, the logprobs it used)
PolicyLossFn = Callable[[torch.Tensor, RolloutBatch], tuple[torch.Tensor, torch.Tensor]]
ShiftFn = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]
TapsFn = Callable[["DraftInputs"], None]  # consumes one micro-batch's taps (the draft's co-training)
# what a plan leaves in `DraftInputs.num_valid_tokens`: only the consumer knows what the loss is normalised over
# (the whole rollout, `ttt_valid_tokens`); NaN, so a consumer that forgets to set it gets a NaN loss, not a wrong one
UNSET_NORMALISER = float("nan")


@dataclass
class DraftInputs:
    """One chunk of what the policy forward leaves for the draft (detached; no second forward)."""

    batch: RolloutBatch  # this chunk's tokens, as the draft sees them (local shard under CP)
    embeds: torch.Tensor
    tap_hidden: list[torch.Tensor]
    teacher_logits: torch.Tensor  # [T, V] logits, or [T, Vd] logprobs over the draft vocabulary (with teacher_top1)
    attention_ops: object  # local ops, or the CP ring ops of this batch
    shift_fn: ShiftFn | None  # None: shift within documents; CP passes its boundary exchange
    num_valid_tokens: float  # global normaliser of the TTT loss (UNSET_NORMALISER from a plan: the consumer sets it)
    teacher_top1: torch.Tensor | None = None  # [T] the policy's full-vocabulary argmax, when the teacher is restricted


@dataclass
class PolicyUpdateResult:
    loss: torch.Tensor  # the update's loss: every rank's shares summed (detached)
    logprobs: torch.Tensor  # detached logprobs of this rank's targets
    batch: RolloutBatch  # the part of the batch those logprobs belong to (its micro-batches back to back)


class TrainPlan(Protocol):
    is_rollout_rank: bool  # rank 0: shares the rollout and gathers weights for export
    hosts_draft: bool  # the draft and its optimizer live here

    def share(self, obj): ...

    def policy_forward_backward(self, policy: LlamaForCausalLM, batch: RolloutBatch, loss_fn: PolicyLossFn,
                                tap_layers: tuple[int, ...], backward: Callable, on_taps: TapsFn | None = None,
                                micro_batch_tokens: int | None = None,
                                teacher_t2d: torch.Tensor | None = None) -> PolicyUpdateResult: ...

    def reduce_gradients(self, module: nn.Module) -> None: ...

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor: ...

    # the policy's full tensors for the engines: on rank 0, and on every rank when `everywhere` (one engine per TP
    # group: each rank loads its own); None on the others (collective where the weights are sharded or staged)
    def policy_weights(self, policy: LlamaForCausalLM,
                       everywhere: bool = False) -> list[tuple[str, torch.Tensor]] | None: ...

    # optional: plans whose draft is not on every rank (PP) or sharded (FSDP) gather it the same way
    def draft_weights(self, draft: nn.Module, everywhere: bool = False) -> list[tuple[str, torch.Tensor]] | None: ...


def ttt_valid_tokens(batch: RolloutBatch) -> float:
    """Pass-1 anchors with a teacher: position i+1 in the same document predicts a response token."""
    from spectrain.models.eagle3 import shift_within_docs

    return float(shift_within_docs(batch.response_mask.float(), batch.cu_seqlens, 1).sum().clamp_min(1.0))


class TapCollector:
    """An `on_taps` that keeps every micro-batch's taps, normalised over `batch` (the rollout they are a part of):
    for benchmarks and tests that train the draft on a whole step's taps at once."""

    def __init__(self, batch: RolloutBatch) -> None:
        self.num_valid_tokens = ttt_valid_tokens(batch)
        self.chunks: list[DraftInputs] = []

    def __call__(self, taps: DraftInputs) -> None:
        self.chunks.append(replace(taps, num_valid_tokens=self.num_valid_tokens))


def draft_inputs_from(out: CausalLMOutput, batch: RolloutBatch, ops, shift_fn, num_valid_tokens: float) -> DraftInputs:
    """The draft's inputs from one policy forward: its teacher restricted to the draft vocabulary when the forward
    computed it (`teacher_t2d`), else its full logits."""
    if out.teacher is not None:
        teacher, top1 = out.teacher
    else:
        assert out.logits is not None, "a forward for the draft computes its teacher or the logits"
        teacher, top1 = out.logits.detach(), None
    assert out.embeds is not None, "a forward for the draft keeps the embeddings"
    return DraftInputs(batch, out.embeds.detach(), [h.detach() for h in out.tap_hidden], teacher, ops, shift_fn,
                       num_valid_tokens, top1)


def micro_batch_forward_backward(policy: LlamaForCausalLM, mb: RolloutBatch, loss_fn: PolicyLossFn, tap_layers,
                                 backward, on_taps: TapsFn | None, ops, shift_fn: ShiftFn | None,
                                 teacher_t2d: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward, loss and backward of one micro-batch (`mb`: this rank's tokens of it), then its taps to `on_taps`;
    its loss share and logprobs, detached. No [T, V] logits exist: the lm_head runs in chunks for the logprobs and,
    with taps, for the teacher over the draft vocabulary `teacher_t2d` (`ops/chunked_logprobs.py`)."""
    teacher = teacher_t2d if tap_layers else None
    out = policy(mb.input_ids, mb.position_ids, mb.cu_seqlens, tap_layers=tap_layers,
                 compute_logits=bool(tap_layers) and teacher is None, logprob_targets=mb.targets, teacher_t2d=teacher)
    loss, logprobs = loss_fn(out.logprobs, mb)
    backward(loss)
    if tap_layers:
        assert on_taps is not None, "taps captured for nobody"
        on_taps(draft_inputs_from(out, mb, ops, shift_fn, UNSET_NORMALISER))
    return loss.detach(), logprobs.detach()


class LocalPlan:
    """One process: the whole batch, in micro-batches of at most `micro_batch_tokens` tokens."""

    is_rollout_rank = True
    hosts_draft = True

    def share(self, obj):
        return obj

    def policy_forward_backward(self, policy, batch, loss_fn, tap_layers, backward, on_taps=None,
                                micro_batch_tokens=None, teacher_t2d=None) -> PolicyUpdateResult:
        parts = micro_batches(batch, micro_batch_tokens)
        done = [micro_batch_forward_backward(policy, mb, loss_fn, tap_layers, backward, on_taps, policy.attention_ops,
                                             None, teacher_t2d) for mb in parts]
        return PolicyUpdateResult(torch.stack([loss for loss, _ in done]).sum(),
                                  torch.cat([lp for _, lp in done]), concat_batches(parts, batch))

    def reduce_gradients(self, module: nn.Module) -> None:
        pass

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)

    def policy_weights(self, policy, everywhere: bool = False):
        tied = policy.cfg.tie_word_embeddings
        return [(n, p.detach()) for n, p in policy.state_dict().items() if not (tied and n == "lm_head.weight")]

    def draft_weights(self, draft, everywhere: bool = False):
        from spectrain.models.eagle3 import draft_sync_weights

        return draft_sync_weights(draft)

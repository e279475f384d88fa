"""How one GRPO step is laid out over ranks: the seam between the module and the parallelisms.

`GRPOModule` runs the same step everywhere: the rollout rank generates, `share` hands the
rollout to every rank, `policy_forward_backward` runs the policy over this rank's part of
the batch (whole batch; a dp slice; zigzag shards under CP; pipeline microbatches under
PP) and leaves `DraftInputs` for the draft, `reduce_gradients` makes the gradients the
single-process ones. Every rank holds the whole rollout, so global token counts (the loss
normalisers) are computed locally and need no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from spectrain.models.llama import CausalLMOutput, LlamaForCausalLM
from spectrain.batch import RolloutBatch

# (logits [T, V] of this rank's tokens, the matching batch part) -> (this part's share of the
# global loss, logprobs of its targets)
PolicyLossFn = Callable[[torch.Tensor, RolloutBatch], tuple[torch.Tensor, torch.Tensor]]
ShiftFn = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]


@dataclass
class DraftInputs:
    """One chunk of what the policy forward leaves for the draft (detached; no second forward)."""

    batch: RolloutBatch  # this chunk's tokens, as the draft sees them (local shard under CP)
    embeds: torch.Tensor
    tap_hidden: list[torch.Tensor]
    teacher_logits: torch.Tensor
    attention_ops: object  # local ops, or the CP ring ops of this batch
    shift_fn: ShiftFn | None  # None: shift within documents; CP passes its boundary exchange
    num_valid_tokens: float  # global normaliser of the TTT loss


@dataclass
class PolicyStepResult:
    loss: torch.Tensor  # this rank's share of the global loss (detached)
    logprobs: torch.Tensor  # detached logprobs of this rank's targets
    batch: RolloutBatch  # the part of the batch those logprobs belong to
    draft_inputs: list[DraftInputs]  # empty where the draft does not live or is not trained


class TrainPlan(Protocol):
    is_rollout_rank: bool  # drives the engine and syncs weights into it
    hosts_draft: bool  # the draft and its optimizer live here

    def share(self, obj): ...

    def policy_forward_backward(self, policy: LlamaForCausalLM, batch: RolloutBatch, loss_fn: PolicyLossFn,
                                tap_layers: tuple[int, ...], backward: Callable) -> PolicyStepResult: ...

    def reduce_gradients(self, module: nn.Module) -> None: ...

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor: ...

    def policy_weights(self, policy: LlamaForCausalLM) -> list[tuple[str, torch.Tensor]] | None: ...

    # optional: plans whose draft is not on the rollout rank (PP) gather it there; None elsewhere
    def draft_weights(self, draft: nn.Module) -> list[tuple[str, torch.Tensor]] | None: ...


def ttt_valid_tokens(batch: RolloutBatch) -> float:
    """Pass-1 anchors with a teacher: position i+1 in the same document predicts a response token."""
    from spectrain.models.eagle3 import shift_within_docs

    return float(shift_within_docs(batch.response_mask.float(), batch.cu_seqlens, 1).sum().clamp_min(1.0))


def draft_inputs_from(out: CausalLMOutput, batch: RolloutBatch, ops, shift_fn, num_valid_tokens: float) -> DraftInputs:
    return DraftInputs(batch, out.embeds.detach(), [h.detach() for h in out.tap_hidden], out.logits.detach(),
                       ops, shift_fn, num_valid_tokens)


class LocalPlan:
    """One process: the whole batch in one forward."""

    is_rollout_rank = True
    hosts_draft = True

    def share(self, obj):
        return obj

    def policy_forward_backward(self, policy, batch, loss_fn, tap_layers, backward) -> PolicyStepResult:
        out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=tap_layers)
        loss, logprobs = loss_fn(out.logits, batch)
        backward(loss)
        inputs = [draft_inputs_from(out, batch, policy.attention_ops, None, ttt_valid_tokens(batch))] \
            if tap_layers else []
        return PolicyStepResult(loss.detach(), logprobs.detach(), batch, inputs)

    def reduce_gradients(self, module: nn.Module) -> None:
        pass

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)

    def policy_weights(self, policy):
        tied = policy.cfg.tie_word_embeddings
        return [(n, p.detach()) for n, p in policy.state_dict().items() if not (tied and n == "lm_head.weight")]

    def draft_weights(self, draft):
        from spectrain.models.eagle3 import draft_sync_weights

        return draft_sync_weights(draft)

"""The one draft update: TTT unroll on the policy's taps, loss, backward, clip, optimizer step.

Co-training (`DraftCoTraining`, once per GRPO step), spot training in the rollout's long tail,
the offline warm-up and the benchmarks all call `draft_update`; they differ only in where the
taps come from and in how ranks combine (`sum_over_ranks`, `reduce_gradients`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_warn

from spectrain.models.eagle3 import Eagle3Draft, TTTMetrics, ttt_loss
from spectrain.parallel.plan import DraftInputs


@dataclass
class DraftUpdate:
    loss: float  # the update's TTT loss (summed over ranks: each holds its share)
    metrics: TTTMetrics  # per-pass sums, summed over ranks
    applied: bool  # False: skipped for a non-finite loss or gradient norm, the draft untouched
    grad_norm: float = math.nan  # after the gradient reduction; NaN where not computed (a NaN loss, no draft here)


def chunk_loss(draft: Eagle3Draft, chunk: DraftInputs, ttt_passes: int, pass_decay: float,
               loss_kernel: str = "auto") -> tuple[torch.Tensor, TTTMetrics]:
    """TTT loss of one chunk of taps (one micro-batch, or one PP microbatch), already divided by the global
    valid-token count, so the chunks' losses add up to the update's. The chunk carries the attention ops
    and shift of its layout (ring + boundary exchange under CP). The draft returns normed hidden states
    and `loss_kernel` (`draft.loss_kernel`) applies the lm_head with the loss, without whole-chunk logits
    where it is `chunked` or `triton`."""
    b = chunk.batch
    hidden = draft(chunk.embeds, chunk.tap_hidden, b.position_ids, b.cu_seqlens, ttt_passes,
                   ops=chunk.attention_ops, shift_fn=chunk.shift_fn, normed_hidden=True)
    return ttt_loss(hidden, chunk.teacher_logits, b.response_mask, b.cu_seqlens, draft.t2d, pass_decay,
                    num_valid_tokens=chunk.num_valid_tokens, shift_fn=chunk.shift_fn,
                    lm_head=draft.lm_head.weight, loss_kernel=loss_kernel, teacher_top1=chunk.teacher_top1)


def add_metrics(a: TTTMetrics | None, b: TTTMetrics) -> TTTMetrics:
    return b if a is None else TTTMetrics(a.loss_sum + b.loss_sum, a.correct + b.correct, a.count + b.count)


def draft_loss(draft: Eagle3Draft, chunks: Sequence[DraftInputs], ttt_passes: int,
               pass_decay: float, loss_kernel: str = "auto") -> tuple[torch.Tensor, TTTMetrics]:
    """TTT loss over the chunks one policy forward left: the sum of their `chunk_loss`es."""
    assert chunks, "no taps to train the draft on"
    total, metrics = None, None
    for chunk in chunks:
        loss, m = chunk_loss(draft, chunk, ttt_passes, pass_decay, loss_kernel)
        total = loss if total is None else total + loss
        metrics = add_metrics(metrics, m)
    assert total is not None and metrics is not None  # there is a chunk
    return total, metrics


def _zero_share(ttt_passes: int, dtype: torch.dtype) -> tuple[torch.Tensor, TTTMetrics]:
    """`draft_loss`'s result on a rank without the draft: zeros of the same dtypes (one dtype per collective)."""
    zeros = torch.zeros(ttt_passes)
    return torch.zeros((), dtype=dtype), TTTMetrics(zeros.to(dtype), zeros.clone(), zeros.clone())


def _same_everywhere(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class DraftGradients:
    """A draft update accumulated chunk by chunk: each chunk's loss is backpropagated as soon as its taps
    arrive (and the taps freed), then `finish` takes the one optimizer step. The result equals one backward
    of the summed loss (`draft_update`), so a step's taps never have to be held at once."""

    def __init__(self, draft: Eagle3Draft, optimizer: torch.optim.Optimizer, *, ttt_passes: int, pass_decay: float,
                 backward: Callable[[torch.Tensor], None] = torch.Tensor.backward, loss_kernel: str = "auto") -> None:
        self.draft, self.optimizer = draft, optimizer
        self.ttt_passes, self.pass_decay = ttt_passes, pass_decay
        self.backward, self.loss_kernel = backward, loss_kernel
        self.loss: torch.Tensor | None = None  # the detached sum of the chunks' losses so far
        self.metrics: TTTMetrics | None = None
        optimizer.zero_grad(set_to_none=True)

    def add(self, chunk: DraftInputs) -> None:
        loss, metrics = chunk_loss(self.draft, chunk, self.ttt_passes, self.pass_decay, self.loss_kernel)
        self.backward(loss)
        self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
        self.metrics = add_metrics(self.metrics, metrics)

    def finish(self, grad_clip: float, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] = _same_everywhere,
               reduce_gradients: Callable[[torch.nn.Module], None] | None = None,
               share_dtype: torch.dtype = torch.float32) -> DraftUpdate:
        """Sum the shares over ranks, then clip and step, or skip a non-finite update (gradients dropped: the draft
        and its optimizer state stay as they were). A rank without chunks (e.g. an early PP stage) adds zeros of
        `share_dtype`, so every rank runs the same collectives and takes the same decision."""
        hosts = self.loss is not None and self.metrics is not None  # set together by `add`
        if self.loss is not None and self.metrics is not None:
            loss, metrics = self.loss, self.metrics
        else:
            loss, metrics = _zero_share(self.ttt_passes, share_dtype)
        total = sum_over_ranks(loss.clone())
        metrics = TTTMetrics(*(sum_over_ranks(t.detach()) for t in (metrics.loss_sum, metrics.correct, metrics.count)))
        applied, grad_norm = math.isfinite(total.item()), math.nan
        if hosts and applied:
            if reduce_gradients is not None:
                reduce_gradients(self.draft)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), grad_clip).item()
            applied = math.isfinite(grad_norm)
        if not applied:
            self.optimizer.zero_grad(set_to_none=True)
        elif hosts:
            self.optimizer.step()
        return DraftUpdate(total.item(), metrics, applied, grad_norm)


def draft_optimizer(draft: Eagle3Draft, lr: float) -> torch.optim.AdamW:
    """The draft's AdamW, the same for the warm-up and online co-training, so the warm-up's state carries over."""
    return torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)


def draft_update(draft: Eagle3Draft, optimizer: torch.optim.Optimizer, chunks: Sequence[DraftInputs], *,
                 ttt_passes: int, pass_decay: float, grad_clip: float,
                 backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
                 sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] = _same_everywhere,
                 reduce_gradients: Callable[[torch.nn.Module], None] | None = None,
                 share_dtype: torch.dtype = torch.float32, loss_kernel: str = "auto") -> DraftUpdate:
    """One optimizer step of the draft on `chunks` (the policy's detached taps and teacher logits) held at once:
    the warm-up, spot updates and benchmarks. Co-training feeds `DraftGradients` micro-batch by micro-batch.

    A non-finite loss or gradient norm skips the step and leaves the draft and its optimizer
    state untouched (callers warn: `warn_if_skipped`); the policy is never touched. Across
    ranks: each rank passes its own chunks (none where the draft does not live), `sum_over_ranks`
    adds the shares so every rank takes the same skip decision, and `reduce_gradients` makes the
    gradients the single-process ones before clipping. `loss_kernel` is `draft.loss_kernel`.
    """
    grads = DraftGradients(draft, optimizer, ttt_passes=ttt_passes, pass_decay=pass_decay, backward=backward,
                           loss_kernel=loss_kernel)
    for chunk in chunks:
        grads.add(chunk)
    return grads.finish(grad_clip, sum_over_ranks, reduce_gradients, share_dtype)


def warn_if_skipped(update: DraftUpdate, where: str) -> None:
    """Say so when `draft_update` skipped a non-finite update. Skipping, not stopping, is deliberate: the draft
    only speeds up rollouts, its inputs are detached from the policy, and a skipped update leaves it and its
    optimizer as they were, so a bad batch costs one update of the draft, never the run (docs/cotraining.md)."""
    if not update.applied:
        rank_zero_warn(f"[spectrain] draft update skipped ({where}): loss {update.loss:.4g}, gradient norm "
                       f"{update.grad_norm:.4g}: not finite. The draft and its optimizer are unchanged and the "
                       f"policy is untouched; if it repeats (draft/skipped_steps), lower draft.lr, check the rewards "
                       f"and policy/grad_norm, or train in float32 (policy.dtype=float32) if it is bf16 overflow.")

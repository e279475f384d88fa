"""`DraftCoTraining`: train the EAGLE-3 draft from the policy's own training forward."""
from __future__ import annotations

import math
import time

import torch
from lightning.pytorch.callbacks import Callback

from spectrain.models.eagle3 import TTTMetrics, ttt_loss


class DraftCoTraining(Callback):
    """One draft step per policy step (or every `every_n_steps`), on the taps the policy
    forward left in `pl_module.draft_inputs`: no extra target forward.

    The draft has its own optimizer (the module's second) and gradient clipping. A
    non-finite loss or gradient norm skips the draft step (counted and logged); the policy
    is never touched: taps and teacher logits are detached.

    Args:
        every_n_steps: train the draft on every n-th policy step.
        grad_clip: max global norm of the draft's gradients.
        ttt_steps: K, the training-time-test passes unrolled.
        pass_decay: weight `pass_decay**(d-1)` of pass d's loss.
    """

    def __init__(self, every_n_steps: int = 1, grad_clip: float = 1.0, ttt_steps: int = 3,
                 pass_decay: float = 0.8) -> None:
        self.every_n_steps = every_n_steps
        self.grad_clip = grad_clip
        self.ttt_steps = ttt_steps
        self.pass_decay = pass_decay
        self.steps_trained = 0
        self.steps_skipped = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.global_step - 1) % self.every_n_steps:
            # NaN, not nothing: Lightning would repeat the last trained step's values in this row
            pl_module.log_dict(self._metrics(math.nan, math.nan, [math.nan] * self.ttt_steps,
                                             [math.nan] * self.ttt_steps), on_step=True, batch_size=1)
            return
        started = time.perf_counter()
        hosts = pl_module.plan.hosts_draft
        # Under PP only the last stage holds the draft: the other ranks add zeros to the sums below, so
        # every rank runs the same collectives and rank 0 (the logger) logs the step's numbers.
        loss, metrics = (draft_loss(pl_module, self.ttt_steps, self.pass_decay) if hosts
                         else _zero_share(pl_module, self.ttt_steps))
        # Under dp/cp each rank holds its share of the step: sum them (identity on one process), so the
        # skip decision is the same on every rank and the logs are the step's.
        total = trainer.strategy.reduce(loss.detach().clone(), reduce_op="sum")
        metrics = TTTMetrics(*(trainer.strategy.reduce(t, reduce_op="sum")
                               for t in (metrics.loss_sum, metrics.correct, metrics.count)))
        # The raw torch optimizer: stepping Lightning's wrapper would advance global_step twice per batch.
        optimizer = pl_module.optimizers()[1].optimizer
        optimizer.zero_grad(set_to_none=True)
        skipped = not math.isfinite(total.item())
        if hosts and not skipped:
            pl_module.manual_backward(loss)
            pl_module.plan.reduce_gradients(pl_module.draft)
            grad_norm = torch.nn.utils.clip_grad_norm_(pl_module.draft.parameters(), self.grad_clip)
            skipped = not math.isfinite(grad_norm.item())
        if skipped:
            optimizer.zero_grad(set_to_none=True)
            self.steps_skipped += 1
        else:
            if hosts:
                optimizer.step()
            self.steps_trained += 1
        seconds = trainer.strategy.reduce(torch.tensor(time.perf_counter() - started), reduce_op="max")  # the host's
        pl_module.log_dict(self._metrics(total.item(), seconds.item(), metrics.loss.tolist(), metrics.accuracy.tolist()),
                           on_step=True, batch_size=1)

    def _metrics(self, loss: float, seconds: float, pass_losses: list[float], pass_top1: list[float]) -> dict:
        log = {"draft/loss": loss, "draft/seconds": seconds, "draft/skipped_steps": float(self.steps_skipped)}
        for d, (pass_loss, top1) in enumerate(zip(pass_losses, pass_top1), start=1):
            log[f"draft/pass_{d}_loss"] = pass_loss
            log[f"draft/pass_{d}_top1"] = top1
        return log

    def state_dict(self) -> dict:
        return {"steps_trained": self.steps_trained, "steps_skipped": self.steps_skipped}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps_trained = state_dict["steps_trained"]
        self.steps_skipped = state_dict["steps_skipped"]


def draft_loss(pl_module, ttt_steps: int, pass_decay: float):
    """TTT loss over the chunks the policy forward left (one, or one per PP microbatch).

    Each chunk's loss is already divided by the global valid-token count, so the sum is the
    step's loss; the chunk carries the attention ops and shift of its layout (ring + boundary
    exchange under CP).
    """
    draft = pl_module.draft
    total, metrics = None, None
    for chunk in pl_module.draft_inputs:
        b = chunk.batch
        logits = draft(chunk.embeds, chunk.aux_hidden, b.position_ids, b.cu_seqlens, ttt_steps,
                       ops=chunk.attention_ops, shift_fn=chunk.shift_fn)
        loss, m = ttt_loss(logits, chunk.teacher_logits, b.response_mask, b.cu_seqlens, draft.t2d, pass_decay,
                           num_valid_tokens=chunk.num_valid_tokens, shift_fn=chunk.shift_fn)
        total = loss if total is None else total + loss
        metrics = m if metrics is None else TTTMetrics(metrics.loss_sum + m.loss_sum, metrics.correct + m.correct,
                                                         metrics.count + m.count)
    return total, metrics


def _zero_share(pl_module, ttt_steps: int):
    """`draft_loss`'s result on a rank without the draft: zeros of the same dtypes (one dtype per collective)."""
    dtype = torch.promote_types(next(pl_module.policy.parameters()).dtype, torch.float32)  # the teacher's
    zeros = torch.zeros(ttt_steps)
    return torch.zeros((), dtype=dtype), TTTMetrics(zeros.to(dtype), zeros.clone(), zeros.clone())

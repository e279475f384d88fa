"""`DraftCoTraining`: train the EAGLE-3 draft from the policy's own training forward."""
from __future__ import annotations

import math
import time

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from spectrain.train.draft_update import draft_update, warn_if_skipped


class DraftCoTraining(Callback):
    """One draft update per step (or every `every_n_steps` steps), on the taps the policy
    forward left in `pl_module.draft_inputs`: no extra target forward.

    A thin adapter over `spectrain.train.draft_update.draft_update` (the same update the
    warm-up and long-tail spot training run): the draft has its own optimizer (the module's
    second) and gradient clipping; a non-finite loss or gradient norm skips the update
    (counted, logged as `draft/skipped_steps`, warned); the policy is never touched: taps and
    teacher logits are detached.
    One per run, under the class name as its state key: a second instance would update the
    same draft twice per step, and Lightning refuses two stateful callbacks with one key.

    Args:
        every_n_steps: update the draft on every n-th step.
        grad_clip: max global norm of the draft's gradients.
        ttt_passes: K, the training-time-test passes unrolled.
        pass_decay: weight `pass_decay**(d-1)` of pass d's loss.
        loss_kernel: `draft.loss_kernel`, the implementation of the lm_head + soft CE.
    """

    def __init__(self, every_n_steps: int = 1, grad_clip: float = 1.0, ttt_passes: int = 3,
                 pass_decay: float = 0.8, loss_kernel: str = "auto") -> None:
        self.every_n_steps = every_n_steps
        self.grad_clip = grad_clip
        self.ttt_passes = ttt_passes
        self.pass_decay = pass_decay
        self.loss_kernel = loss_kernel
        self.steps_trained = 0
        self.steps_skipped = 0

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.global_step - 1) % self.every_n_steps:
            # NaN, not nothing: Lightning would repeat the last trained step's values in this row
            pl_module.log_dict({**self._metrics(math.nan, math.nan, [math.nan] * self.ttt_passes,
                                                [math.nan] * self.ttt_passes), "draft/lr": math.nan},
                               on_step=True, batch_size=1)
            return
        started = time.perf_counter()
        # Under PP only the last stage holds the draft: the others pass no taps and add zeros to the sums.
        update = draft_update(
            pl_module.draft, pl_module.draft_optimizer(),
            pl_module.draft_inputs if pl_module.plan.hosts_draft else [],
            ttt_passes=self.ttt_passes, pass_decay=self.pass_decay, grad_clip=self.grad_clip,
            backward=pl_module.manual_backward,
            sum_over_ranks=lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
            reduce_gradients=pl_module.plan.reduce_gradients, share_dtype=pl_module.teacher_dtype,
            loss_kernel=self.loss_kernel)
        lr = pl_module.draft_optimizer().param_groups[0]["lr"]  # the rate this update used
        pl_module.count_draft_update(update)
        if update.applied:
            self.steps_trained += 1
        else:
            self.steps_skipped += 1
            warn_if_skipped(update, f"step {trainer.global_step}, {self.steps_skipped} skipped so far")
        seconds = trainer.strategy.reduce(torch.tensor(time.perf_counter() - started), reduce_op="max")  # the host's
        pl_module.log_dict({**self._metrics(update.loss, seconds.item(), update.metrics.loss.tolist(),
                                            update.metrics.accuracy.tolist()), "draft/lr": lr},
                           on_step=True, batch_size=1)

    def _metrics(self, loss: float, seconds: float, pass_losses: list[float], pass_top1: list[float]) -> dict:
        log = {"draft/loss": loss, "draft/seconds": seconds, "draft/skipped_steps": float(self.steps_skipped)}
        for d, (pass_loss, top1) in enumerate(zip(pass_losses, pass_top1), start=1):
            log[f"draft/pass_{d}_loss"] = pass_loss
            log[f"draft/pass_{d}_top1"] = top1
        return log

    @override
    def state_dict(self) -> dict:
        return {"steps_trained": self.steps_trained, "steps_skipped": self.steps_skipped}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.steps_trained = state_dict["steps_trained"]
        self.steps_skipped = state_dict["steps_skipped"]

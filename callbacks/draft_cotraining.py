"""`DraftCoTraining`: train the EAGLE-3 draft from the policy's own training forward."""
from __future__ import annotations

import math
import time

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from spectrain.parallel.plan import DraftInputs
from spectrain.train.draft_update import DraftGradients, warn_if_skipped


class DraftCoTraining(Callback):
    """One draft update per step (or every `every_n_steps` steps), from the policy's own training
    forward: no extra target forward, and no taps held past their micro-batch.

    The module hands it each micro-batch's taps and teacher logits of the step's first epoch as
    soon as the policy forward made them (`on_draft_taps`, a `DraftInputs`); their TTT loss is
    backpropagated at once (`DraftGradients`) and the taps are freed. `on_train_batch_end` takes
    the one optimizer step. The draft has its own optimizer (the module's second) and gradient
    clipping; a non-finite loss or gradient norm skips the update (counted, logged as
    `draft/skipped_steps`, warned); the policy is never touched: taps and teacher logits are
    detached. One per run, under the class name as its state key: a second instance would update
    the same draft twice per step, and Lightning refuses two stateful callbacks with one key.

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
        self._grads: DraftGradients | None = None  # this step's update, while the policy forwards feed it
        self._seconds = 0.0

    def wants_draft_taps(self, trainer) -> bool:
        """Whether the step about to run trains the draft (the module captures taps only then)."""
        return trainer.global_step % self.every_n_steps == 0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._grads, self._seconds = None, 0.0
        if self.wants_draft_taps(trainer):
            self._grads = DraftGradients(pl_module.draft, pl_module.draft_optimizer(), ttt_passes=self.ttt_passes,
                                         pass_decay=self.pass_decay, backward=pl_module.manual_backward,
                                         loss_kernel=self.loss_kernel)

    def on_draft_taps(self, trainer, pl_module, taps: DraftInputs) -> None:
        """One micro-batch's taps (this rank's: under PP only the last stage gets any), consumed now."""
        assert self._grads is not None, "taps for a step that does not train the draft"
        started = time.perf_counter()
        self._grads.add(taps)
        self._seconds += time.perf_counter() - started

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._grads is None:
            # NaN, not nothing: Lightning would repeat the last trained step's values in this row
            pl_module.log_dict({**self._metrics(math.nan, math.nan, [math.nan] * self.ttt_passes,
                                                [math.nan] * self.ttt_passes), "draft/lr": math.nan},
                               on_step=True, batch_size=1)
            return
        started = time.perf_counter()
        # Under PP the ranks without the draft's taps add zeros to the sums.
        update = self._grads.finish(self.grad_clip,
                                    sum_over_ranks=lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
                                    reduce_gradients=pl_module.plan.reduce_gradients,
                                    share_dtype=pl_module.teacher_dtype)
        self._grads = None
        lr = pl_module.draft_optimizer().param_groups[0]["lr"]  # the rate this update used
        pl_module.count_draft_update(update)
        if update.applied:
            self.steps_trained += 1
        else:
            self.steps_skipped += 1
            warn_if_skipped(update, f"step {trainer.global_step}, {self.steps_skipped} skipped so far")
        elapsed = self._seconds + time.perf_counter() - started
        seconds = trainer.strategy.reduce(torch.tensor(elapsed), reduce_op="max")  # the host's
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

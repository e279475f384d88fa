"""`DraftCoTraining`: the step's draft update, from the policy's own training forward."""
from __future__ import annotations

import math
import time

import torch
from lightning.pytorch.callbacks import Callback

from spectrain.parallel.plan import DraftInputs
from spectrain.train.draft_update import warn_if_skipped
from spectrain.train.online_draft import OnlineDraft
from spectrain.train.step import DraftReport, StepModule


class DraftCoTraining(Callback):
    """The `draft_update` phase of the step (a `DraftUpdater`): one draft update per step (or every
    `draft.every_n_steps` steps, less while the draft holds: `draft.hold_tolerance`), from the policy's own
    training forward: no extra target forward, and no taps held past their micro-batch.

    The module asks `begin_draft_update` after the rollout; when it starts an update, the module hands it each
    micro-batch's taps and teacher logits of the first epoch as soon as the policy forward made them
    (`on_draft_taps`); their TTT loss is backpropagated at once and the taps are freed. `update_draft` takes the
    one optimizer step after the policy updates. The draft and all of its training state (optimizer, lr ramp,
    counters, the hold rule) are the module's `OnlineDraft` (`module.draft`); this callback decides through it
    and logs. A non-finite loss or gradient norm skips the update (counted, logged as `draft/skipped_steps`,
    warned); the policy is never touched.
    """

    def __init__(self) -> None:
        self._seconds = 0.0  # this step's update so far (the taps' backward passes)

    def begin_draft_update(self, module: StepModule, step: int) -> bool:
        """Start step `step`'s update when the gate and the hold rule let it train the draft (on every rank)."""
        draft = module.draft
        assert draft is not None, "DraftCoTraining without a draft"
        if not draft.trains_at(step):
            return False
        draft.begin_update(module.manual_backward)
        self._seconds = 0.0
        return True

    def on_draft_taps(self, module: StepModule, taps: DraftInputs) -> None:
        """One micro-batch's taps (this rank's: under PP only the last stage gets any), consumed now."""
        started = time.perf_counter()
        assert module.draft is not None
        module.draft.add_taps(taps)
        self._seconds += time.perf_counter() - started

    def update_draft(self, module: StepModule, step: int) -> DraftReport | None:
        draft = module.draft
        assert draft is not None
        lr = draft.lr  # the rate this update uses
        started = time.perf_counter()
        update = draft.finish_update(module.sum_over_ranks, module.plan.reduce_gradients, module.teacher_dtype)
        module.log("draft/updated", float(update is not None), on_step=True, batch_size=1)
        if update is None:
            # NaN, not nothing: Lightning would repeat the last trained step's values in this row
            passes = [math.nan] * draft.training.ttt_passes
            module.log_dict({**self._metrics(draft, math.nan, math.nan, passes, passes), "draft/lr": math.nan},
                            on_step=True, batch_size=1)
            return None
        if not update.applied:
            warn_if_skipped(update, f"step {step}, {draft.updates_skipped} skipped so far")
        elapsed = self._seconds + time.perf_counter() - started
        seconds = module.max_over_ranks(torch.tensor(elapsed)).item()  # the host's
        report = DraftReport(update.applied, update.loss, update.metrics.loss.tolist(),
                             update.metrics.accuracy.tolist(), lr, draft.version)
        module.log_dict({**self._metrics(draft, update.loss, seconds, report.pass_losses, report.pass_top1),
                         "draft/lr": lr}, on_step=True, batch_size=1)
        return report

    @staticmethod
    def _metrics(draft: OnlineDraft, loss: float, seconds: float, pass_losses: list[float],
                 pass_top1: list[float]) -> dict:
        log = {"draft/loss": loss, "draft/seconds": seconds, "draft/skipped_steps": float(draft.updates_skipped),
               "draft/version": float(draft.version)}
        for d, (pass_loss, top1) in enumerate(zip(pass_losses, pass_top1), start=1):
            log[f"draft/pass_{d}_loss"] = pass_loss
            log[f"draft/pass_{d}_top1"] = top1
        return log

"""`DraftCoTraining`: train the EAGLE-3 draft from the policy's own training forward."""
from __future__ import annotations

import math
import time

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from spectrain.parallel.fsdp import shard_optimizer_state
from spectrain.parallel.plan import DraftInputs
from spectrain.train.draft_update import DraftGradients, DraftUpdate, draft_optimizer, draft_update, warn_if_skipped

STATE_KEY = "DraftCoTraining"  # the class name, Lightning's default key: what checkpoints already hold
HOLD_WINDOW = 8  # rollouts whose best acceptance gain a held draft is measured against


def migrate_draft_optimizer(checkpoint: dict) -> None:
    """Checkpoints written before `DraftCoTraining` owned the draft's optimizer hold it as the module's second
    optimizer and its lr ramp as the first scheduler: move them into the callback's state (dropped for a run
    without co-training, which has no draft optimizer), so the policy's optimizer and schedule load as before."""
    optimizers = checkpoint.get("optimizer_states") or []
    if len(optimizers) != 2:
        return
    schedulers = checkpoint.get("lr_schedulers") or []
    optimizer, ramp = optimizers.pop(1), (schedulers.pop(0) if schedulers else None)
    state = checkpoint.get("callbacks", {}).get(STATE_KEY)
    if state is not None and "optimizer" not in state:
        state.update(optimizer=optimizer, lr_ramp=ramp)


class DraftCoTraining(Callback):
    """One draft update per step (or every `every_n_steps` steps), from the policy's own training
    forward: no extra target forward, and no taps held past their micro-batch.

    The module hands it each micro-batch's taps and teacher logits of the step's first epoch as
    soon as the policy forward made them (`on_draft_taps`, a `DraftInputs`); their TTT loss is
    backpropagated at once (`DraftGradients`) and the taps are freed. `on_train_batch_end` takes
    the one optimizer step. It owns all of the draft's training state: its AdamW (started from the
    warm-up's moments when given them, so the first online updates are not full-size sign steps of
    a fresh Adam), the linear lr ramp over the first `lr_ramp_updates` applied updates, and the
    counts; all are checkpointed in its state, gathered to full tensors under FSDP. Long-tail spot
    updates step the same optimizer and ramp (`spot_update`). A non-finite loss or gradient norm
    skips the update (counted, logged as `draft/skipped_steps`, warned); the policy is never
    touched: taps and teacher logits are detached. One per run, under the class name as its state
    key: a second instance would update the same draft twice per step, and Lightning refuses two
    stateful callbacks with one key.

    With `hold_tolerance > 0` it also skips updates while the draft holds: when the last rollout's
    acceptance gain (length - 1) is at least `1 - hold_tolerance` of the best gain of the
    `HOLD_WINDOW` rollouts before it, the step goes without an update (no taps captured either),
    but never more than `max_held_steps` steps in a row. A drop below that line (the policy moved
    away from the draft) brings the updates back at once. The decision uses the previous step's
    rollout, the latest the draft's quality is known from when the step starts.

    Args:
        every_n_steps: update the draft on every n-th step.
        grad_clip: max global norm of the draft's gradients.
        ttt_passes: K, the training-time-test passes unrolled.
        pass_decay: weight `pass_decay**(d-1)` of pass d's loss.
        loss_kernel: `draft.loss_kernel`, the implementation of the lm_head + soft CE.
        hold_tolerance: skip updates while acceptance holds within this fraction of its recent best (0: never).
        max_held_steps: the most steps in a row without a draft update.
        lr: the online learning rate, reached after the ramp.
        lr_ramp_updates: the ramp's length in applied updates (0: the full lr at once).
        warmup_optimizer_state: the offline warm-up's AdamW `state_dict` (full tensors) to continue from, or None.
    """

    def __init__(self, every_n_steps: int = 1, grad_clip: float = 1.0, ttt_passes: int = 3,
                 pass_decay: float = 0.8, loss_kernel: str = "auto", lr: float = 3e-4, lr_ramp_updates: int = 10,
                 warmup_optimizer_state: dict | None = None, hold_tolerance: float = 0.0,
                 max_held_steps: int = 4) -> None:
        assert 0 <= hold_tolerance < 1 and max_held_steps >= 1, (hold_tolerance, max_held_steps)
        self.every_n_steps = every_n_steps
        self.hold_tolerance, self.max_held_steps = hold_tolerance, max_held_steps
        self.grad_clip = grad_clip
        self.ttt_passes = ttt_passes
        self.pass_decay = pass_decay
        self.loss_kernel = loss_kernel
        self.lr, self.lr_ramp_updates = lr, lr_ramp_updates
        self.warmup_optimizer_state = warmup_optimizer_state
        self.optimizer: torch.optim.Optimizer | None = None  # built for the (sharded) draft at fit start
        self.lr_ramp: torch.optim.lr_scheduler.LambdaLR | None = None
        self.steps_trained = 0
        self.steps_skipped = 0
        self.recent_gains: list[float] = []  # acceptance gains of the last rollouts, oldest first
        self.steps_without_update = 0  # in a row, up to the last step
        self._restored: dict | None = None  # a checkpoint's optimizer and ramp, until the optimizer exists
        self._strategy = None  # gathers the optimizer's shards for a checkpoint
        self._grads: DraftGradients | None = None  # this step's update, while the policy forwards feed it
        self._seconds = 0.0

    @classmethod
    def from_config(cls, d, warmup_optimizer_state: dict | None = None) -> DraftCoTraining:
        """The callback for a `draft` config section (`spectrain fit`'s; the warm-up's state only if it is carried)."""
        return cls(every_n_steps=d.every_n_steps, grad_clip=d.grad_clip, ttt_passes=d.ttt_passes,
                   pass_decay=d.pass_decay, loss_kernel=d.loss_kernel, lr=d.lr, lr_ramp_updates=d.lr_ramp_updates,
                   warmup_optimizer_state=warmup_optimizer_state if d.carry_warmup_optimizer else None,
                   hold_tolerance=d.hold_tolerance, max_held_steps=d.max_held_steps)

    @property
    @override
    def state_key(self) -> str:
        return STATE_KEY

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        """The optimizer over the draft's parameters as the strategy left them (sharded under FSDP); the warm-up's
        moments, then a checkpoint's state, each cut to this rank's shards."""
        self._strategy = trainer.strategy
        self.optimizer = draft_optimizer(pl_module.draft, self.lr)
        if self.warmup_optimizer_state is not None:
            self._load_full_state(self.optimizer, self.warmup_optimizer_state)
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr
        ramp = self.lr_ramp_updates
        self.lr_ramp = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda u: min(1.0, (u + 1) / (ramp + 1)))
        self._apply_restored()

    def _apply_restored(self) -> None:
        if self._restored is None or self.optimizer is None:
            return
        self._load_full_state(self.optimizer, self._restored["optimizer"])
        if self._restored["lr_ramp"] is not None:
            self.lr_ramp.load_state_dict(self._restored["lr_ramp"])
        self._restored = None

    @staticmethod
    def _load_full_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)
        shard_optimizer_state(optimizer)  # a no-op for unsharded parameters

    def count_update(self, update: DraftUpdate) -> None:
        """Advance the lr ramp by one applied update (co-training or spot)."""
        if update.applied:
            self.lr_ramp.step()

    def spot_update(self, pl_module, taps) -> DraftUpdate:
        """One long-tail spot update of the draft on `taps` (whole, held by the module), with this optimizer."""
        update = draft_update(pl_module.draft, self.optimizer, taps, ttt_passes=self.ttt_passes,
                              pass_decay=self.pass_decay, grad_clip=self.grad_clip, backward=pl_module.manual_backward,
                              loss_kernel=self.loss_kernel)
        self.count_update(update)
        return update

    def wants_draft_taps(self, trainer) -> bool:
        """Whether the step about to run trains the draft (the module captures taps only then)."""
        return trainer.global_step % self.every_n_steps == 0 and not self.draft_holds()

    def draft_holds(self) -> bool:
        """The last rollout's acceptance gain is within `hold_tolerance` of the recent mean, above or below it (a
        falling draft needs updates, and so does a climbing one: a cold draft learning a shifted task), and the
        draft has not gone `max_held_steps` steps without an update."""
        if not self.hold_tolerance or self.steps_without_update >= self.max_held_steps or len(self.recent_gains) < 2:
            return False
        *earlier, last = self.recent_gains
        recent = sum(earlier) / len(earlier)
        return abs(last - recent) <= self.hold_tolerance * recent

    def observe_acceptance(self, spec) -> None:
        """Keep the rollout's acceptance gain (`spec`: its `SpecStats`) for the hold decision; nothing if it drafted
        nothing (k=0)."""
        if spec.num_drafts:
            self.recent_gains = [*self.recent_gains, spec.mean_acceptance_length - 1.0][-(HOLD_WINDOW + 1):]

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._grads, self._seconds = None, 0.0
        if self.wants_draft_taps(trainer):
            self._grads = DraftGradients(pl_module.draft, self.optimizer, ttt_passes=self.ttt_passes,
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
        self.observe_acceptance(outputs["step"].rollout.spec)
        trained = self._grads is not None
        self.steps_without_update = 0 if trained else self.steps_without_update + 1
        pl_module.log("draft/updated", float(trained), on_step=True, batch_size=1)
        if not trained:
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
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this update used
        self.count_update(update)
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
        state = {"steps_trained": self.steps_trained, "steps_skipped": self.steps_skipped,
                 "recent_gains": list(self.recent_gains), "steps_without_update": self.steps_without_update}
        if self.optimizer is not None:  # full tensors (collective under FSDP: every rank saves a checkpoint)
            state.update(optimizer=self._strategy.optimizer_state(self.optimizer), lr_ramp=self.lr_ramp.state_dict())
        return state

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.steps_trained = state_dict["steps_trained"]
        self.steps_skipped = state_dict["steps_skipped"]
        self.recent_gains = list(state_dict.get("recent_gains", []))  # absent from checkpoints before the hold
        self.steps_without_update = state_dict.get("steps_without_update", 0)
        if "optimizer" in state_dict:
            self._restored = {"optimizer": state_dict["optimizer"], "lr_ramp": state_dict.get("lr_ramp")}
            self._apply_restored()  # now, if a strategy restores after its setup (the optimizer exists then)

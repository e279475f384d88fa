"""`OnlineDraft`: the draft's one owner, as vLLM's EAGLE proposer owns the engine's drafter.

Everything the run knows about its draft lives here, behind one `state_dict`: the model and its
weights' version, the optimizer and lr ramp, the gate (`draft.every_n_steps`) and hold rule
(`draft.hold_tolerance`), the gradients of the update in progress, the taps kept for the long
tail's spot updates, the copy last sent to the engines, and one acceptance history. The module
holds it (`GRPOModule.draft`); `DraftCoTraining` decides and logs the co-training through it, and
`WeightSync` sends it and reads its version.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spectrain.models.eagle3 import Eagle3Draft
from spectrain.parallel.fsdp import shard_optimizer_state
from spectrain.parallel.plan import DraftInputs
from spectrain.train.draft_update import DraftGradients, DraftUpdate, draft_optimizer, draft_update

HOLD_WINDOW = 8  # rollouts whose mean acceptance gain a held draft is measured against
ACCEPTANCE_WINDOW = 10  # rollouts the acceptance history keeps (the sync's collapse check takes its median)
MIN_DRAFTS = 20  # drafts a rollout needs before its acceptance says anything about the draft


@dataclass(frozen=True)
class DraftTraining:
    """How the draft trains online (the `draft.*` keys of the same names)."""

    every_n_steps: int = 1  # update the draft on every n-th step
    grad_clip: float = 1.0  # max global norm of the draft's gradients
    ttt_passes: int = 3  # K, the training-time-test passes unrolled
    pass_decay: float = 0.8  # weight pass_decay**(d-1) of pass d's loss
    loss_kernel: str = "auto"  # draft.loss_kernel: the implementation of the lm_head + soft CE
    lr: float = 3e-4  # the online learning rate, reached after the ramp
    lr_ramp_updates: int = 10  # the ramp's length in applied updates (0: the full lr at once)
    hold_tolerance: float = 0.0  # skip updates while acceptance holds within this fraction of its recent mean
    max_held_steps: int = 4  # the most steps in a row without a draft update

    def __post_init__(self) -> None:
        assert 0 <= self.hold_tolerance < 1 and self.max_held_steps >= 1, (self.hold_tolerance, self.max_held_steps)

    @classmethod
    def from_config(cls, d) -> DraftTraining:
        return cls(every_n_steps=d.every_n_steps, grad_clip=d.grad_clip, ttt_passes=d.ttt_passes,
                   pass_decay=d.pass_decay, loss_kernel=d.loss_kernel, lr=d.lr, lr_ramp_updates=d.lr_ramp_updates,
                   hold_tolerance=d.hold_tolerance, max_held_steps=d.max_held_steps)


class OnlineDraft:
    """The draft model and all of its state (see the module docstring).

    `version` counts the applied updates (co-training and spot): the weights at the start are version 0, and the
    engines serve `sent_version`. `acceptance` holds the acceptance gains (length - 1) of the last rollouts that
    drafted at least `MIN_DRAFTS` times, oldest first: the hold rule and the sync's collapse check read the same one.
    A non-finite update is skipped (counted in `updates_skipped`); the policy is never touched: taps and teacher
    logits are detached.
    """

    def __init__(self, model: Eagle3Draft, training: DraftTraining | None = None,
                 warmup_optimizer_state: dict | None = None) -> None:
        self.model = model
        self.training = training or DraftTraining()
        self.warmup_optimizer_state = warmup_optimizer_state  # the offline warm-up's AdamW state (full tensors)
        self.version = 0
        self.sent_version: int | None = None  # None: the engines serve the draft they started from
        self.sent: list[tuple[str, torch.Tensor]] = []  # CPU copies of the last sync's tensors, for the liveness probe
        self.acceptance: list[float] = []
        self.updates_applied = 0
        self.updates_skipped = 0
        self.steps_without_update = 0  # in a row, up to the last step
        # built for the (sharded) model by `setup`
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_ramp: torch.optim.lr_scheduler.LambdaLR | None = None
        self.gradients: DraftGradients | None = None  # the update in progress, while the policy forwards feed it
        self.tail_taps: list[DraftInputs] = []  # the last step's taps, for the long tail's spot updates
        self._restored: dict | None = None  # a checkpoint's optimizer and ramp, until `setup` built them
        self._gather_optimizer: Callable[[torch.optim.Optimizer], dict] | None = None

    # set-up and checkpoints --------------------------------------------------------------
    def setup(self, gather_optimizer: Callable[[torch.optim.Optimizer], dict]) -> None:
        """The optimizer over the parameters as the strategy left them (sharded under FSDP); the warm-up's moments,
        then a checkpoint's, each cut to this rank's shards. `gather_optimizer` gives the full state for a
        checkpoint (collective under FSDP)."""
        self._gather_optimizer = gather_optimizer
        optimizer = self.optimizer = draft_optimizer(self.model, self.training.lr)
        if self.warmup_optimizer_state is not None:
            _load_sharded(optimizer, self.warmup_optimizer_state)
            self.warmup_optimizer_state = None  # full-size moments: not held for the whole run
            for group in optimizer.param_groups:
                group["lr"] = self.training.lr
        ramp = self.training.lr_ramp_updates
        self.lr_ramp = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / (ramp + 1)))
        self._apply_restored()

    def _trained_by(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        assert self.optimizer is not None and self.lr_ramp is not None, "the draft's optimizer is built by setup()"
        return self.optimizer, self.lr_ramp

    def state_dict(self) -> dict:
        """Versions, counters, acceptance history and (once `setup` ran) the optimizer and ramp in full tensors."""
        state: dict = {"version": self.version, "sent_version": self.sent_version, "acceptance": list(self.acceptance),
                       "updates_applied": self.updates_applied, "updates_skipped": self.updates_skipped,
                       "steps_without_update": self.steps_without_update}
        if self.optimizer is not None and self._gather_optimizer is not None:
            optimizer, ramp = self._trained_by()
            state.update(optimizer=self._gather_optimizer(optimizer), lr_ramp=ramp.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.version, self.sent_version = state["version"], state["sent_version"]
        self.acceptance = list(state["acceptance"])
        self.updates_applied, self.updates_skipped = state["updates_applied"], state["updates_skipped"]
        self.steps_without_update = state["steps_without_update"]
        if "optimizer" in state:
            self._restored = {"optimizer": state["optimizer"], "lr_ramp": state["lr_ramp"]}
            self._apply_restored()  # now, if the strategy restores after `setup`

    def _apply_restored(self) -> None:
        if self._restored is None or self.optimizer is None:
            return
        optimizer, ramp = self._trained_by()
        _load_sharded(optimizer, self._restored["optimizer"])
        ramp.load_state_dict(self._restored["lr_ramp"])
        self._restored = None

    # the gate and the hold rule ----------------------------------------------------------
    def trains_at(self, step: int) -> bool:
        """Whether GRPO step `step` (from 1) updates the draft: every `every_n_steps`-th step, unless it holds."""
        return (step - 1) % self.training.every_n_steps == 0 and not self.holds()

    def holds(self) -> bool:
        """The last rollout's acceptance gain is within `hold_tolerance` of the recent mean, above or below it (a
        falling draft needs updates, and so does a climbing one: a cold draft learning a shifted task), and the
        draft has not gone `max_held_steps` steps without an update."""
        t = self.training
        recent = self.acceptance[-(HOLD_WINDOW + 1):]
        if not t.hold_tolerance or self.steps_without_update >= t.max_held_steps or len(recent) < 2:
            return False
        *earlier, last = recent
        mean = sum(earlier) / len(earlier)
        return abs(last - mean) <= t.hold_tolerance * mean

    def observe(self, spec) -> None:
        """Keep a rollout's acceptance gain (`spec`: its `SpecDecodeCounters`) once it drafted `MIN_DRAFTS` times."""
        if spec.num_drafts >= MIN_DRAFTS:
            self.acceptance = [*self.acceptance, spec.mean_acceptance_length - 1.0][-(ACCEPTANCE_WINDOW + 1):]

    # updates -----------------------------------------------------------------------------
    def begin_update(self, backward: Callable[[torch.Tensor], None]) -> None:
        """Start this step's update: each micro-batch's taps are backpropagated as they come (`add_taps`)."""
        t = self.training
        self.gradients = DraftGradients(self.model, self._trained_by()[0], ttt_passes=t.ttt_passes,
                                        pass_decay=t.pass_decay, backward=backward, loss_kernel=t.loss_kernel)

    def add_taps(self, taps: DraftInputs) -> None:
        assert self.gradients is not None, "taps for a step that does not train the draft"
        self.gradients.add(taps)

    def finish_update(self, sum_over_ranks, reduce_gradients, share_dtype: torch.dtype) -> DraftUpdate | None:
        """The one optimizer step of the step's update (None when the step did not train the draft); under PP the
        ranks without the draft's taps add zeros to the sums, so every rank takes the same decision."""
        trained, self.gradients = self.gradients, None
        self.steps_without_update = 0 if trained is not None else self.steps_without_update + 1
        if trained is None:
            return None
        return self._count(trained.finish(self.training.grad_clip, sum_over_ranks=sum_over_ranks,
                                          reduce_gradients=reduce_gradients, share_dtype=share_dtype))

    def spot_update(self, backward: Callable[[torch.Tensor], None]) -> DraftUpdate:
        """One long-tail spot update on the last step's taps (one process), with the same optimizer and ramp."""
        t = self.training
        return self._count(draft_update(self.model, self._trained_by()[0], self.tail_taps, ttt_passes=t.ttt_passes,
                                        pass_decay=t.pass_decay, grad_clip=t.grad_clip, backward=backward,
                                        loss_kernel=t.loss_kernel))

    def _count(self, update: DraftUpdate) -> DraftUpdate:
        if update.applied:
            self._trained_by()[1].step()
            self.updates_applied += 1
            self.version += 1
        else:
            self.updates_skipped += 1
        return update

    @property
    def lr(self) -> float:
        """The rate the next update uses."""
        return self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else math.nan

    # the engines' copy -------------------------------------------------------------------
    @property
    def changed_since_sent(self) -> bool:
        return self.sent_version != self.version

    def mark_sent(self, weights: list[tuple[str, torch.Tensor]], keep_copy: bool) -> None:
        """The engines now serve `version`; `keep_copy` keeps CPU copies of `weights` for the liveness probe."""
        self.sent_version = self.version
        self.sent = [(name, t.detach().to("cpu", copy=True)) for name, t in weights] if keep_copy else []


def _load_sharded(optimizer: torch.optim.Optimizer, state: dict) -> None:
    optimizer.load_state_dict(state)
    shard_optimizer_state(optimizer)  # a no-op for unsharded parameters

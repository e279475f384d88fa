"""`WeightSync`: push the policy and the draft into the live rollout engine after each step."""
from __future__ import annotations

import time

from lightning.pytorch.callbacks import Callback


class SpeculationDeadError(RuntimeError):
    """The engine drafted but accepted nothing after a draft sync: the drafter was lost."""


class WeightSync(Callback):
    """Versioned policy + draft sync, with a liveness check of speculation after draft syncs.

    A drafter lost in the engine (e.g. freed by sleep mode) yields an acceptance length of
    exactly 1.00 and no error, so after each draft sync the next rollout must accept at least
    one drafted token once it has seen `min_drafts_for_check` drafts.

    Args:
        check_alive: raise `SpeculationDeadError` when the check fails.
        min_drafts_for_check: drafts needed before the check is meaningful.
    """

    def __init__(self, check_alive: bool = True, min_drafts_for_check: int = 20) -> None:
        self.check_alive = check_alive
        self.min_drafts_for_check = min_drafts_for_check
        self.policy_version = 0
        self.draft_version = 0
        self._draft_check_pending = False

    def on_train_start(self, trainer, pl_module) -> None:
        # The engine was started from the exported weights; after a resume the module holds newer ones.
        self._push(trainer, pl_module, draft=pl_module.draft is not None, log_time=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._verify_speculation(pl_module)
        self._push(trainer, pl_module, draft=pl_module.trains_draft, log_time=True)

    def _push(self, trainer, pl_module, draft: bool, log_time: bool) -> None:
        version = trainer.global_step
        started = time.perf_counter()
        # every rank gathers (collective under PP); only the rollout rank holds an engine
        weights = pl_module.policy_weights_for_sync()
        if pl_module.plan.is_rollout_rank:
            pl_module.engine.sync_policy(weights, version)
        self.policy_version = version
        if draft:
            weights = pl_module.draft_weights_for_sync()
            if pl_module.plan.is_rollout_rank:
                pl_module.engine.sync_draft(weights, version)
            self.draft_version = version
            self._draft_check_pending = self.check_alive
        if log_time:  # Lightning refuses step metrics in on_train_start
            pl_module.log("time/weight_sync", time.perf_counter() - started, on_step=True, batch_size=1)

    def _verify_speculation(self, pl_module) -> None:
        spec = pl_module.rollout_stats.spec if pl_module.rollout_stats else None
        if not self._draft_check_pending or spec is None or spec.num_drafts < self.min_drafts_for_check:
            return
        self._draft_check_pending = False
        if spec.num_accepted_tokens == 0:
            raise SpeculationDeadError(
                f"after draft sync version {self.draft_version} the engine drafted {spec.num_drafts} times and "
                f"accepted nothing (mean acceptance length 1.00): the drafter is not the synced draft. Check that "
                f"the engine was not put to sleep at level 2, that the draft's parameter names match the vLLM "
                f"EAGLE-3 checkpoint, or disable the check with draft.check_alive=false while debugging."
            )

    def state_dict(self) -> dict:
        return {"policy_version": self.policy_version, "draft_version": self.draft_version}

    def load_state_dict(self, state_dict: dict) -> None:
        self.policy_version = state_dict["policy_version"]
        self.draft_version = state_dict["draft_version"]

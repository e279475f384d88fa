"""TLT's spot training: draft updates in the rollout's long tail, one at a time between engine steps."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LongTailPolicy:
    """Says when few enough sequences are live that idle capacity can train the draft.

    In the rollout's long tail a handful of long sequences hold the workers; while some, but
    fewer than `threshold`, are live the draft may take (pre-emptible) spot updates, published
    at the next weight sync; at most `max_updates` per rollout.
    """

    threshold: int
    max_updates: int

    def should_train(self, live_batch_size: int, updates_taken: int) -> bool:
        """Take one more spot update now? (`updates_taken` in this rollout so far)."""
        return 0 < live_batch_size < self.threshold and updates_taken < self.max_updates


class LongTailTrainer:
    """Runs spot updates between engine steps (the step loop's `idle_hook`).

    While `policy.should_train(live, updates)` holds it runs one `spot_update()` and hands control
    back, so the rollout is never held up by more than one draft update. The trained draft
    reaches the engine at the next weight sync.
    """

    def __init__(self, policy: LongTailPolicy, spot_update: Callable[[], Any]) -> None:
        self.policy = policy
        self.spot_update = spot_update
        self.updates = 0  # in the current rollout
        self.seconds = 0.0

    def begin_rollout(self) -> None:
        self.updates, self.seconds = 0, 0.0

    def maybe_run(self, live: int) -> bool:
        if not self.policy.should_train(live, self.updates):
            return False
        started = time.perf_counter()
        self.spot_update()
        self.seconds += time.perf_counter() - started
        self.updates += 1
        return True

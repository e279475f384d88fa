"""Who sets `k` before each engine step of the step loop, and how a config picks one.

Controllers answer `before_step(live) -> k` and see each step's `StepRecord`
(`spectrain.rollout.step_loop.generate_stepwise`). `StepwiseRollouts` (stepwise.py) builds one
with `build_controller` when `speculation.mode` is not `fixed`.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from spectrain.config import SpecTrainConfig
from spectrain.rollout.speculation.bandit import (
    BanditSelector,
    SpecArm,
    accepted_tokens_per_second,
    buckets_by_verify_budget,
)
from spectrain.rollout.speculation.calibration import load_verify_budget
from spectrain.rollout.speculation.rule import ConcurrencyAwareRule
from spectrain.rollout.step_loop import SpecController, StepRecord


class FixedK(SpecController):
    """The same `k` at every step: the baselines."""

    def __init__(self, k: int) -> None:
        self.k = k

    def before_step(self, live: int) -> int:
        return self.k


class ConcurrencyController(SpecController):
    """FastGRPO's rule, re-evaluated every step, so `k` deepens as sequences finish."""

    def __init__(self, rule: ConcurrencyAwareRule) -> None:
        self.rule = rule

    def before_step(self, live: int) -> int:
        return self.rule.num_speculative_tokens(live)


class BanditController(SpecController):
    """TLT's bandit, one decision per two engine steps.

    The `k` set before a step is proposed at its end and verified in the next step, so a
    decision holds its arm for two steps and is rewarded (accepted tokens per second) with
    the second one, which both verifies and proposes with that arm.
    """

    HOLD_STEPS = 2

    def __init__(self, selector: BanditSelector) -> None:
        self.selector = selector
        self._arm: SpecArm | None = None
        self._live = 0  # the live batch the arm was selected for
        self._held = 0
        self.decisions: list[tuple[str, str]] = []  # (arm, reason) of the current rollout

    def begin_rollout(self) -> None:
        self._arm = None
        self.decisions = []

    def before_step(self, live: int) -> int:
        if self._arm is None:
            self._arm, reason = self.selector.select(live)
            self._live, self._held = live, 0
            self.decisions.append((self._arm.name, reason))
        return self._arm.num_speculative_tokens

    def after_step(self, record: StepRecord) -> None:
        self._held += 1
        if self._held < self.HOLD_STEPS:
            return
        assert self._arm is not None, "after_step follows before_step"
        self.selector.update(self._arm, self._live, accepted_tokens_per_second(
            record.mean_acceptance_length, record.live, record.seconds))
        self._arm = None

    def rollout_metrics(self) -> dict[str, float]:
        counts = Counter(self.decisions)
        return {f"bandit/{arm}_{reason}": float(n) for (arm, reason), n in sorted(counts.items())}

    def state_dict(self) -> dict[str, Any]:
        return {"selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.selector.load_state_dict(state["selector"])


def engine_spec_schedule(config: SpecTrainConfig) -> list[tuple[int, int, int]] | None:
    """`spec_schedule` to start the engine with, so that a controller may change `k` at runtime."""
    if config.draft.mode == "none" or config.speculation.mode == "fixed":
        return None
    return [(1, 1, config.draft.num_speculative_tokens)]


def build_controller(config: SpecTrainConfig, engine, run_dir: str | Path) -> SpecController | None:
    """The controller `speculation.mode` asks for (None for `fixed`: the engine's own `k`).

    `engine` must have been started with `engine_spec_schedule(config)`; its
    `num_speculative_tokens` is `k_max`.
    """
    s = config.speculation
    if s.mode == "fixed":
        return None
    k_max = engine.num_speculative_tokens
    engine.set_num_speculative_tokens(k_max)  # fails early, with the fix, if k cannot change at runtime
    budget = load_verify_budget(config, run_dir)
    if s.mode == "concurrency":
        return ConcurrencyController(ConcurrencyAwareRule(budget, k_max))
    b = s.bandit  # arms <= k_max is checked when the config loads
    arms = [SpecArm(k) for k in b.arms]
    return BanditController(BanditSelector(arms, buckets_by_verify_budget(arms, b.bucket_edges, budget),
                                           epsilon=b.epsilon, window=b.window, seed=config.trainer.seed,
                                           min_plays=b.min_plays))

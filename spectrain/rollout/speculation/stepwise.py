"""Rollouts through the step loop: the `k` controller's lifecycle, spot updates, and what they log.

`GRPOModule` hands a rollout here when `k` adapts per engine step or the long tail trains the
draft (`uses_step_loop`). The controller is built on the first rollout (it needs the live
engine and the verify budget C) and its state is checkpointed, so a resumed bandit continues
from what it learned. With an engine on every rank, each rank runs its own controller on the
lockstepped loop's shared view, so every engine gets the same `k` at every engine step.
"""
from __future__ import annotations

from typing import Any

from spectrain.config import SpecTrainConfig
from spectrain.rollout.engine import Completion, Sampling
from spectrain.rollout.speculation.controllers import build_controller
from spectrain.rollout.speculation.long_tail import LongTailTrainer
from spectrain.rollout.step_loop import EngineLockstep, SpecController, generate_stepwise
from spectrain.rollout.vllm.engine import VLLMRolloutEngine


class StepwiseRollouts:
    def __init__(self, config: SpecTrainConfig) -> None:
        self.config = config
        self.controller: SpecController | None = None  # built on the first rollout (adaptive modes)
        self._state: dict[str, Any] | None = None  # from a checkpoint, until the controller exists
        self.metrics: dict[str, float] = {}  # of the last rollout

    def generate(self, engine: VLLMRolloutEngine, prompts: list[list[int]], sampling: Sampling,
                 spot: LongTailTrainer | None, lockstep: EngineLockstep | None = None) -> list[Completion]:
        if self.controller is None and self.config.speculation.mode != "fixed":
            self.controller = build_controller(self.config, engine, self.config.trainer.run_dir)
            if self._state is not None and self.controller is not None:
                self.controller.load_state_dict(self._state)
        result = generate_stepwise(engine, prompts, sampling, self.controller, spot, lockstep)
        steps = max(len(result.trace), 1)
        self.metrics = {"rollout/engine_steps": float(len(result.trace)),
                        "spec/k_mean": sum(r.k for r in result.trace) / steps}
        if spot is not None:
            self.metrics.update({"spot/draft_updates": float(spot.updates), "spot/seconds": spot.seconds})
        if self.controller is not None:
            self.metrics.update(self.controller.rollout_metrics())
        return result.completions

    def state_dict(self) -> dict[str, Any] | None:
        return self.controller.state_dict() if self.controller is not None else self._state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self._state = state
        if self.controller is not None and state:
            self.controller.load_state_dict(state)

"""One GRPO step's types: its phases, its result, and the contracts between the module and its callbacks.

`GRPOModule.training_step` runs the phases in `PHASES` order, each one call, each timed into
`StepResult.seconds`. Two phases are callbacks' (the extension points the design asks for), called
through typed protocols at named points of the step: `DraftUpdater` (draft co-training: it gets the
policy forwards' taps, then makes the draft update) and `WeightSyncer` (pushes both models to the
engines and verifies them). `bind_step_callbacks` finds them among the trainer's callbacks at fit
start: at most one of each. Every other callback observes the finished step (`StepResult`, as
`outputs["step"]` in `on_train_batch_end`) and reads the module only through `StepModule`.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from spectrain.batch import RolloutBatch
from spectrain.config import SpecTrainConfig
from spectrain.errors import ConfigError
from spectrain.models.llama import LlamaForCausalLM
from spectrain.parallel.plan import DraftInputs, TrainPlan
from spectrain.rollout.engine import LoadStats, RolloutEngine, SpecDecodeCounters
from spectrain.rollout.engine_layout import EngineLayout
from spectrain.train.online_draft import OnlineDraft

Phase = Literal["rollout", "rewards", "advantages", "policy_updates", "draft_update", "weight_sync"]
PHASES: tuple[Phase, ...] = ("rollout", "rewards", "advantages", "policy_updates", "draft_update", "weight_sync")


@dataclass
class RolloutStats:
    seconds: float  # generation only (the slowest engine's); scoring is the `rewards` phase
    num_sequences: int
    num_tokens: int
    spec: SpecDecodeCounters  # this rollout's delta of the engines' counters, summed over the engines
    load: LoadStats  # preemptions and peak running/waiting sequences during this rollout
    per_engine_acceptance: list[float] = field(default_factory=list)  # each engine's acceptance length, in order

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class PolicyReport:
    """The step's policy updates (`GRPOModule.policy_updates`)."""

    updates: int  # policy updates made (grpo.minibatches x grpo.ppo_epochs)
    loss: float  # mean over the updates
    grad_norm: float  # mean over the updates, before clipping
    clip_fraction: float
    kl: float
    engine_logprob_diff: float  # mean |trainer - engine| logprob of the rollout's tokens before the first update
    lr: float  # the rate the updates used


@dataclass(frozen=True)
class DraftReport:
    """The step's draft update (`DraftUpdater.update_draft`); None in `StepResult.draft` when the step made none."""

    applied: bool  # False: skipped for a non-finite loss or gradient norm, the draft untouched
    loss: float
    pass_losses: list[float]  # per TTT pass
    pass_top1: list[float]
    lr: float  # the rate the update used
    version: int  # the draft's version after it


@dataclass(frozen=True)
class SyncReport:
    """The step's weight sync (`WeightSyncer.sync_weights`)."""

    policy_version: int  # the GRPO step whose policy the engines now serve
    draft_version: int | None  # the draft's version sent this step; None: not re-sent (unchanged, or no draft)
    mismatches: int  # the run's failed checks so far under sync.on_mismatch=warn


@dataclass(frozen=True)
class StepResult:
    """What one GRPO step did: what was generated, rewarded, trained, synced and measured, and each phase's
    seconds. Every callback gets it as `outputs["step"]` in `on_train_batch_end`. The same on every rank."""

    step: int  # the GRPO step, counted from 1 (as trainer.max_steps counts)
    rollout: RolloutStats  # generation: seconds, sequences, tokens, spec-decode counters, engine load
    rewards: torch.Tensor  # [N] float32, one per completion
    batch: RolloutBatch  # the packed rollout the updates trained on (advantages included)
    policy: PolicyReport  # the policy updates
    draft: DraftReport | None = None  # the draft update, None when the step made none
    sync: SyncReport | None = None  # None only while the weight-sync phase runs
    seconds: dict[str, float] = field(default_factory=dict)  # each phase's, in `PHASES` order


@contextmanager
def timed(seconds: dict[str, float], phase: Phase) -> Iterator[None]:
    """Add the block's wall time to `seconds[phase]`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - started


class StepModule(Protocol):
    """What callbacks may read from the module (`GRPOModule`; test fakes implement it too)."""

    config: SpecTrainConfig
    policy: LlamaForCausalLM
    draft: OnlineDraft | None  # the draft's one owner
    plan: TrainPlan
    engine: RolloutEngine | None  # this rank's engine
    engines: EngineLayout
    tokenizer: Any

    @property
    def global_step(self) -> int:
        """Finished GRPO steps (the step in flight is `global_step + 1`)."""
        ...

    @property
    def trains_draft(self) -> bool: ...

    @property
    def teacher_dtype(self) -> torch.dtype: ...

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None: ...

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None: ...

    def log_dict(self, dictionary: Any, *args: Any, **kwargs: Any) -> None: ...

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def max_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def policy_weights_for_sync(self) -> list[tuple[str, torch.Tensor]] | None: ...

    def draft_weights_for_sync(self) -> list[tuple[str, torch.Tensor]] | None: ...

    def evaluate(self, examples: Any, samples: int) -> dict[str, float]: ...

    def measure_speedup(self, examples: Any) -> dict[str, float]: ...


@runtime_checkable
class DraftUpdater(Protocol):
    """The `draft_update` phase: co-trains the draft from the policy's own forwards."""

    def begin_draft_update(self, module: StepModule, step: int) -> bool:
        """Start GRPO step `step`'s draft update if it trains the draft, and say whether it does; asked on every
        rank after the rollout, before the policy updates (the module captures taps only then)."""
        ...

    def on_draft_taps(self, module: StepModule, taps: DraftInputs) -> None:
        """One micro-batch's taps (first epoch), right after its forward and backward."""
        ...

    def update_draft(self, module: StepModule, step: int) -> DraftReport | None:
        """The draft's update after the policy updates; None when this step made none."""
        ...


@runtime_checkable
class WeightSyncer(Protocol):
    """The `weight_sync` phase: the engines serve the step's policy and draft, verified."""

    def sync_weights(self, module: StepModule, step: StepResult, woke: bool) -> SyncReport:
        """Check the step's rollout (its logprobs, the drafter's liveness), then push and verify the weights.
        `woke`: the engines were asleep during the updates (rollout.enable_sleep_mode)."""
        ...


@dataclass(frozen=True)
class StepCallbacks:
    draft_updater: DraftUpdater | None
    weight_syncer: WeightSyncer | None


def check_callback_order(callbacks: list[object]) -> None:
    """Lightning runs callbacks in list order; a callback that needs others to have run first in a hook names
    their classes in `runs_after` (e.g. `BestCheckpoints` reads `HeldOutEval`'s score of the step). Each of those
    present must come before it."""
    for i, callback in enumerate(callbacks):
        for name in getattr(callback, "runs_after", ()):
            later = [other for other in callbacks[i + 1:] if any(k.__name__ == name for k in type(other).__mro__)]
            if later:
                raise ConfigError(f"trainer callbacks: {type(callback).__name__} must come after "
                                  f"{type(later[0]).__name__} (it reads what that one does in the same hook); "
                                  f"reorder the callbacks list")


def bind_step_callbacks(callbacks: list[object]) -> StepCallbacks:
    """The callbacks that run the step's `draft_update` and `weight_sync` phases: at most one of each (a second
    would update the draft or sync the weights twice per step). Checks the others' order first."""
    check_callback_order(callbacks)
    updaters = [c for c in callbacks if isinstance(c, DraftUpdater)]
    syncers = [c for c in callbacks if isinstance(c, WeightSyncer)]
    for phase, owners in (("draft_update", updaters), ("weight_sync", syncers)):
        if len(owners) > 1:
            names = ", ".join(type(c).__name__ for c in owners)
            raise ConfigError(f"trainer callbacks: {len(owners)} callbacks run the step's {phase} phase ({names}); "
                              f"keep one (each would run it every step)")
    return StepCallbacks(updaters[0] if updaters else None, syncers[0] if syncers else None)

"""TLT's BEG-MAB: learn online which `k` gives the most accepted tokens per second, per batch-size bucket."""
from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spectrain.errors import RunDirError


@dataclass(frozen=True)
class SpecArm:
    """One speculation config the bandit can pick; `num_speculative_tokens=0` drafts nothing."""

    num_speculative_tokens: int

    @property
    def name(self) -> str:
        return "off" if self.num_speculative_tokens == 0 else f"k{self.num_speculative_tokens}"

    @property
    def verify_tokens(self) -> int:
        """Tokens this arm adds to the target forward per sequence (drafts + bonus)."""
        return self.num_speculative_tokens + 1


@dataclass(frozen=True)
class BatchBucket:
    """Arms eligible for batch sizes `lo..hi` (inclusive; `hi=None` is unbounded)."""

    lo: int
    hi: int | None
    arms: tuple[SpecArm, ...]

    def contains(self, batch_size: int) -> bool:
        return batch_size >= self.lo and (self.hi is None or batch_size <= self.hi)


def buckets_by_verify_budget(arms: Sequence[SpecArm], edges: Sequence[int], verify_budget: int) -> list[BatchBucket]:
    """Buckets `[1, e0-1], [e0, e1-1], ..., [e_last, inf)`; an arm is eligible in a bucket when
    its verify tokens fit the budget at the bucket's smallest batch (`lo * (k + 1) <= verify_budget`),
    so small batches get the deep arms.

    The no-speculation arm (k=0), when listed, stays eligible everywhere as a baseline; a
    bucket where nothing fits gets the cheapest arm.
    """
    bounds = [1, *edges]
    buckets = []
    for i, lo in enumerate(bounds):
        hi = bounds[i + 1] - 1 if i + 1 < len(bounds) else None
        fit = tuple(a for a in arms if a.num_speculative_tokens == 0 or lo * a.verify_tokens <= verify_budget)
        buckets.append(BatchBucket(lo, hi, fit or (min(arms, key=lambda a: a.verify_tokens),)))
    return buckets


def accepted_tokens_per_second(mean_acceptance_length: float, batch_size: int, step_time: float) -> float:
    """The bandit's reward: tokens each sequence gains per step (counting the bonus token) times
    the batch, per second."""
    return mean_acceptance_length * batch_size / step_time


class BanditSelector:
    """Epsilon-greedy over speculation configs, per batch-size bucket.

    Statistics are kept per (bucket, arm): rewards (tokens/s) scale with the batch, so only
    arms measured at similar batch sizes are compared. Within a bucket, untried arms are
    played first (in the order given, `min_plays` times each), then with probability
    `epsilon` a uniformly random eligible arm ("explore"), else the arm with the best median
    reward over its last `window` rewards ("exploit"; ties go to the earlier arm). The
    median shrugs off the odd slow step (a weight sync, a preemption); the window lets the
    choice follow a drifting policy and draft.

    Args:
        arms: the configs, e.g. `[SpecArm(0), SpecArm(2), SpecArm(4)]`, distinct.
        buckets: contiguous `BatchBucket`s from batch 1, the last unbounded
            (`buckets_by_verify_budget`); None: one bucket for every batch size, with every arm.
        epsilon: exploration probability.
        window: rewards kept per (bucket, arm) for the median.
        seed: seeds the selector's own RNG (saved in `state_dict`).
        min_plays: plays an arm gets in a bucket before it leaves "untried"; more than 1
            makes a noisy first sample less likely to bury the best arm for long.
    """

    def __init__(self, arms: Sequence[SpecArm], buckets: Sequence[BatchBucket] | None = None, epsilon: float = 0.1,
                 window: int = 300, seed: int = 0, min_plays: int = 1) -> None:
        self.arms = tuple(arms)
        self.buckets = tuple(buckets) if buckets is not None else (BatchBucket(1, None, self.arms),)
        self.epsilon = epsilon
        self.window = window
        self.min_plays = min_plays
        self._index = {a: i for i, a in enumerate(self.arms)}
        self._rng = random.Random(seed)
        self._rewards: list[list[deque[float]]] = [[deque(maxlen=window) for _ in self.arms] for _ in self.buckets]
        self._counts = [[0] * len(self.arms) for _ in self.buckets]

    def bucket_index(self, batch_size: int) -> int:
        return next(i for i, b in enumerate(self.buckets) if b.contains(batch_size))

    def select(self, batch_size: int) -> tuple[SpecArm, str]:
        """The config for a step with `batch_size` live sequences, and why: untried, explore or exploit."""
        bi = self.bucket_index(batch_size)
        eligible = self.buckets[bi].arms
        untried = [a for a in eligible if self._counts[bi][self._index[a]] < self.min_plays]
        if untried:
            return untried[0], "untried"
        if self._rng.random() < self.epsilon:
            return eligible[self._rng.randrange(len(eligible))], "explore"
        medians = [statistics.median(self._rewards[bi][self._index[a]]) for a in eligible]
        return eligible[max(range(len(eligible)), key=lambda i: (medians[i], -i))], "exploit"

    def update(self, arm: SpecArm, batch_size: int, reward: float) -> None:
        """Record the reward (`accepted_tokens_per_second`) of `arm`, selected at `batch_size`."""
        bi, ai = self.bucket_index(batch_size), self._index[arm]
        self._rewards[bi][ai].append(reward)
        self._counts[bi][ai] += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain lists/ints/floats (JSON- and torch.save-friendly) for Lightning checkpoints."""
        version, internal, gauss = self._rng.getstate()
        return {
            "arms": [a.num_speculative_tokens for a in self.arms],
            "buckets": [[b.lo, b.hi, [a.num_speculative_tokens for a in b.arms]] for b in self.buckets],
            "rewards": [[list(w) for w in row] for row in self._rewards],
            "counts": [list(row) for row in self._counts],
            "rng_state": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the learned state; `epsilon`, `window` and `min_plays` stay as configured (windows keep
        their newest `window` rewards).

        The run directory refuses other `speculation` settings on resume, but not a rewritten
        calibration: a new verify budget moves the buckets, and the saved statistics no longer fit.
        """
        mine = self.state_dict()
        if [state["arms"], state["buckets"]] != [mine["arms"], mine["buckets"]]:
            raise RunDirError(f"the checkpoint's bandit buckets {state['buckets']} differ from this run's "
                              f"{mine['buckets']}: the verify budget C changed since the run started (a rerun "
                              f"`spectrain calibrate`?); restore the run directory's calibration.json, or start "
                              f"a new trainer.run_dir")
        self._rewards = [[deque(w, maxlen=self.window) for w in row] for row in state["rewards"]]
        self._counts = [list(row) for row in state["counts"]]
        version, internal, gauss = state["rng_state"]
        self._rng.setstate((version, tuple(internal), gauss))

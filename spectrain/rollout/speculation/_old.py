"""Adaptive speculation: how many draft tokens to verify, given the live rollout batch.

Pure logic, no engine: the rollout engine asks these objects for a speculation config and
feeds back what it measured.

- :class:`ConcurrencyAwareRule` (FastGRPO): a closed-form schedule from a per-machine verify
  budget ``C``. Shrinks speculation as the batch grows so the verify forward stays below the
  point where the target turns compute-bound. Maps onto vLLM 0.32's
  ``num_speculative_tokens_per_batch_size``.
- :class:`BanditSelector` (TLT BEG-MAB): learns online which speculation config gives the most
  accepted tokens per second in each batch-size bucket (epsilon-greedy on windowed medians).
- :func:`calibrate_verify_budget`: find ``C`` from measured forward times.
- :class:`LongTailPolicy`: says when the rollout's long tail leaves capacity idle for spot
  draft training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ConcurrencyAwareRule",
    "RuleDecision",
    "vllm_dynamic_speculative_config",
    "SpecArm",
    "BatchBucket",
    "BanditSelector",
    "buckets_by_verify_budget",
    "accepted_tokens_per_second",
    "CalibrationResult",
    "calibrate_verify_budget",
    "LongTailPolicy",
]


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, minimum: int, hint: str = "") -> int:
    """Reject bools, floats and too-small values with a message that names the fix."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).{hint}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.{hint}")
    return value


def _check_float(name: str, value: Any, *, lo: float, lo_open: bool, hi: float | None = None,
                 hint: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.{hint}")
    if (value <= lo) if lo_open else (value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}.{hint}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}.{hint}")
    return float(value)


# ------------------------------------------------------------- concurrency-aware rule


@dataclass(frozen=True)
class RuleDecision:
    """What the concurrency-aware rule says for one batch size (docs/adaptive_speculation.md)."""

    batch_size: int
    verify_tokens: int  # N_v: tokens verified per sequence per step (drafts + the bonus token)
    depth: int  # L: tree depth
    width: int  # K: tree width
    draft_tokens: int  # T = N_v - 1 (may be -1 when the batch alone exceeds the budget)
    num_speculative_tokens: int  # chain drafts: clamp(T, 0, k_max)


class ConcurrencyAwareRule:
    """FastGRPO's schedule: give each live sequence ``C // B`` verify tokens, capped.

    The target forward costs about the same until ``C`` tokens per step (memory-bound), so
    with ``B`` live sequences each may verify ``C // B`` tokens almost for free. As sequences
    finish, ``B`` drops and speculation deepens.

    Args:
        verify_budget: ``C``, tokens per target forward where it turns compute-bound
            (see :func:`calibrate_verify_budget`).
        k_max: most draft tokens a chain draft may propose (the draft's trained depth).
        n_max: ``N_max``, cap on verify tokens per sequence; ``k_max + 1`` for a chain.
        c: tree shape constant in ``L = floor(log2(N_v / c))``.
        l_min, l_max: depth clamp for tree drafts (``l_max`` defaults to ``k_max``).
        k_width_max: ``K_max``, most tree width (defaults to ``max(1, n_max - 1)``).
    """

    def __init__(
        self,
        verify_budget: int,
        k_max: int,
        n_max: int,
        c: float = 1.0,
        l_min: int = 1,
        l_max: int | None = None,
        k_width_max: int | None = None,
    ) -> None:
        fix_c = " Run `spectrain bench calibrate` (calibrate_verify_budget) to measure it."
        self.verify_budget = _check_int("verify_budget", verify_budget, 1, fix_c)
        self.k_max = _check_int(
            "k_max", k_max, 1,
            " For no speculation use speculation.mode=fixed with speculation.k=0.",
        )
        self.n_max = _check_int("n_max", n_max, 1, " For a chain draft use n_max = k_max + 1.")
        self.c = _check_float("c", c, lo=0.0, lo_open=True)
        self.l_min = _check_int("l_min", l_min, 0)
        self.l_max = _check_int("l_max", k_max if l_max is None else l_max, 0)
        if self.l_min > self.l_max:
            raise ValueError(f"l_min ({self.l_min}) must be <= l_max ({self.l_max}).")
        default_width = max(1, n_max - 1)
        self.k_width_max = _check_int(
            "k_width_max", default_width if k_width_max is None else k_width_max, 1
        )

    def __repr__(self) -> str:
        return (
            f"ConcurrencyAwareRule(verify_budget={self.verify_budget}, k_max={self.k_max}, "
            f"n_max={self.n_max}, c={self.c}, l_min={self.l_min}, l_max={self.l_max}, "
            f"k_width_max={self.k_width_max})"
        )

    def verify_tokens(self, batch_size: int) -> int:
        """``N_v = min(C // B, N_max)``."""
        batch_size = _check_int("batch_size", batch_size, 1)
        return min(self.verify_budget // batch_size, self.n_max)

    def decide(self, batch_size: int) -> RuleDecision:
        """Depth, width and chain length for ``batch_size`` live sequences."""
        n_v = self.verify_tokens(batch_size)
        # log2(0) is -inf: with no budget the depth sits at its lower clamp.
        raw_depth = math.floor(math.log2(n_v / self.c)) if n_v > 0 else self.l_min
        depth = min(max(raw_depth, self.l_min), self.l_max)
        width = max(1, min(n_v - 1, self.k_width_max))
        t = n_v - 1
        k = min(max(t, 0), self.k_max)
        return RuleDecision(batch_size, n_v, depth, width, t, k)

    def num_speculative_tokens(self, batch_size: int) -> int:
        """Chain drafts: ``k = clamp(N_v - 1, 0, k_max)``."""
        return self.decide(batch_size).num_speculative_tokens

    def to_vllm_schedule(self, max_batch: int) -> list[tuple[int, int, int]]:
        """The rule as vLLM 0.32's ``num_speculative_tokens_per_batch_size``.

        Inclusive ranges ``(lo, hi, k)`` covering ``1..max_batch``, starting at 1, contiguous,
        merged where ``k`` is equal. ``k = 0`` is kept: vLLM accepts it per range and skips
        drafting for that step (the drafter still runs its prefill pass). Pass ``max_batch``
        = the engine's ``max_num_seqs``; vLLM carries the last range forward beyond it.
        """
        max_batch = _check_int("max_batch", max_batch, 1, " Use the engine's max_num_seqs.")
        schedule: list[tuple[int, int, int]] = []
        for b in range(1, max_batch + 1):
            k = self.num_speculative_tokens(b)
            if schedule and schedule[-1][2] == k:
                schedule[-1] = (schedule[-1][0], b, k)
            else:
                schedule.append((b, b, k))
        return schedule


def vllm_dynamic_speculative_config(schedule: Sequence[tuple[int, int, int]]) -> dict[str, Any]:
    """The two ``speculative_config`` keys vLLM 0.32 needs for a per-batch-size schedule.

    vLLM clamps every range's ``k`` to ``num_speculative_tokens`` (which must be > 0), so that
    key is set to the schedule's maximum. Merge the result into the engine's
    ``speculative_config`` (``method``, ``model`` ...). Note that vLLM drops the schedule and
    falls back to the static ``num_speculative_tokens`` under data parallelism (DP > 1).
    """
    _validate_schedule(schedule)
    k_top = max(k for _, _, k in schedule)
    if k_top == 0:
        raise ValueError(
            "The schedule gives k=0 at every batch size; vLLM needs num_speculative_tokens > 0. "
            "Disable speculation (speculative_config=None) or raise speculation.verify_budget."
        )
    return {
        "num_speculative_tokens": k_top,
        "num_speculative_tokens_per_batch_size": [tuple(e) for e in schedule],
    }


def _validate_schedule(schedule: Sequence[tuple[int, int, int]]) -> None:
    """Same rules as vLLM's ``validate_and_normalize_dynamic_sd_schedule``, plus contiguity."""
    if not schedule:
        raise ValueError("Schedule is empty; it must cover batch sizes from 1.")
    expected_lo = 1
    for entry in schedule:
        if len(entry) != 3:
            raise ValueError(f"Schedule entry {entry!r} must be (lo, hi, k).")
        lo, hi, k = entry
        if lo != expected_lo or hi < lo or k < 0:
            raise ValueError(
                f"Schedule entry {entry!r} is invalid: ranges must start at 1, be contiguous "
                f"(next lo = {expected_lo}), have lo <= hi and k >= 0."
            )
        expected_lo = hi + 1


# ------------------------------------------------------------------------ bandit


@dataclass(frozen=True)
class SpecArm:
    """One speculation config the bandit can pick; ``num_speculative_tokens=0`` = no draft."""

    num_speculative_tokens: int

    def __post_init__(self) -> None:
        _check_int("SpecArm.num_speculative_tokens", self.num_speculative_tokens, 0)

    @property
    def name(self) -> str:
        return "off" if self.num_speculative_tokens == 0 else f"k{self.num_speculative_tokens}"

    @property
    def verify_tokens(self) -> int:
        """Tokens this arm adds to the target forward per sequence (drafts + bonus)."""
        return self.num_speculative_tokens + 1


@dataclass(frozen=True)
class BatchBucket:
    """Arms eligible for batch sizes ``lo..hi`` (inclusive; ``hi=None`` is unbounded)."""

    lo: int
    hi: int | None
    arms: tuple[SpecArm, ...]

    def __post_init__(self) -> None:
        _check_int("BatchBucket.lo", self.lo, 1)
        if self.hi is not None:
            _check_int("BatchBucket.hi", self.hi, self.lo)
        if not self.arms:
            raise ValueError(
                f"Bucket {self.lo}..{self.hi} has no eligible arms; list at least one."
            )
        object.__setattr__(self, "arms", tuple(self.arms))

    def contains(self, batch_size: int) -> bool:
        return batch_size >= self.lo and (self.hi is None or batch_size <= self.hi)


def buckets_by_verify_budget(
    arms: Sequence[SpecArm], edges: Sequence[int], verify_budget: int
) -> list[BatchBucket]:
    """Buckets ``[1, e0-1], [e0, e1-1], ..., [e_last, inf)``; an arm is eligible in a bucket
    when its verify tokens fit the budget at the bucket's smallest batch
    (``lo * (k + 1) <= verify_budget``), so small batches get the deep arms.

    The no-speculation arm (k=0), when listed, stays eligible everywhere as a baseline; a
    bucket where nothing fits gets the cheapest arm.
    """
    _check_int("verify_budget", verify_budget, 1)
    if not arms:
        raise ValueError("arms is empty; list at least one SpecArm.")
    bounds = [1, *edges]
    if any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:])):
        raise ValueError(f"edges must be strictly increasing and > 1, got {list(edges)}.")
    buckets = []
    for i, lo in enumerate(bounds):
        hi = bounds[i + 1] - 1 if i + 1 < len(bounds) else None
        fit = tuple(
            a for a in arms
            if a.num_speculative_tokens == 0 or lo * a.verify_tokens <= verify_budget
        )
        buckets.append(BatchBucket(lo, hi, fit or (min(arms, key=lambda a: a.verify_tokens),)))
    return buckets


def accepted_tokens_per_second(
    mean_acceptance_length: float, batch_size: int, step_time: float
) -> float:
    """The bandit's reward: tokens each sequence gains per step times the batch, per second."""
    _check_float(
        "mean_acceptance_length", mean_acceptance_length, lo=1.0, lo_open=False,
        hint=" It counts the bonus token (1 + accepted/drafts; 1.0 without speculation); "
        "did you pass the acceptance rate?",
    )
    _check_int("batch_size", batch_size, 1)
    _check_float("step_time", step_time, lo=0.0, lo_open=True, hint=" Pass seconds per step.")
    return mean_acceptance_length * batch_size / step_time


class BanditSelector:
    """TLT's BEG-MAB: epsilon-greedy over speculation configs per batch-size bucket.

    Statistics are kept per (bucket, arm): rewards (tokens/s) scale with the batch, so only
    arms measured at similar batch sizes are compared. Within a bucket, untried arms are
    played first (in the order given, ``min_plays`` times each), then with probability
    ``epsilon`` a uniformly random eligible arm ("explore"), else the arm with the best median
    reward over its last ``window`` rewards ("exploit"; ties go to the earlier arm). The
    median shrugs off the odd slow step (a weight sync, a preemption); the window lets the
    choice follow a drifting policy and draft.

    Args:
        arms: the configs, e.g. ``[SpecArm(0), SpecArm(2), SpecArm(4)]``.
        buckets: contiguous :class:`BatchBucket` s starting at batch 1; ``None`` = one bucket
            for all batch sizes with every arm (see :func:`buckets_by_verify_budget`).
        epsilon: exploration probability.
        window: rewards kept per (bucket, arm) for the median.
        seed: seeds the selector's own RNG (saved in :meth:`state_dict`).
        history_size: most recent decisions kept in :attr:`history` (for logging).
        min_plays: plays an arm gets in a bucket before it leaves "untried"; more than 1
            makes a noisy first sample less likely to bury the best arm for long.
    """

    REASONS = ("untried", "explore", "exploit")

    def __init__(
        self,
        arms: Sequence[SpecArm],
        buckets: Sequence[BatchBucket] | None = None,
        epsilon: float = 0.1,
        window: int = 300,
        seed: int = 0,
        history_size: int = 10_000,
        min_plays: int = 1,
    ) -> None:
        self.arms = self._validate_arms(arms)
        self.buckets = self._validate_buckets(buckets)
        self.epsilon = _check_float("epsilon", epsilon, lo=0.0, lo_open=False, hi=1.0)
        self.window = _check_int("window", window, 1)
        self.min_plays = _check_int("min_plays", min_plays, 1)
        if self.min_plays > self.window:
            raise ValueError(f"min_plays ({min_plays}) must be <= window ({window}).")
        self._index = {a: i for i, a in enumerate(self.arms)}
        self._rng = random.Random(seed)
        nb, na = len(self.buckets), len(self.arms)
        self._rewards = [[deque(maxlen=self.window) for _ in range(na)] for _ in range(nb)]
        self._counts = [[0] * na for _ in range(nb)]
        self.step = 0
        self._pending: dict[str, Any] | None = None
        history_size = _check_int("history_size", history_size, 1)
        self.history: deque[dict[str, Any]] = deque(maxlen=history_size)

    # -- construction ---------------------------------------------------------

    @staticmethod
    def _validate_arms(arms: Sequence[SpecArm]) -> tuple[SpecArm, ...]:
        arms = tuple(arms)
        if not arms:
            raise ValueError(
                "arms is empty; list at least one SpecArm (e.g. SpecArm(0), SpecArm(3))."
            )
        bad = [a for a in arms if not isinstance(a, SpecArm)]
        if bad:
            raise TypeError(f"arms must be SpecArm instances, got {bad!r}.")
        if len(set(arms)) != len(arms):
            raise ValueError(f"arms has duplicates: {[a.name for a in arms]}.")
        return arms

    def _validate_buckets(self, buckets: Sequence[BatchBucket] | None) -> tuple[BatchBucket, ...]:
        if buckets is None:
            return (BatchBucket(1, None, self.arms),)
        buckets = tuple(buckets)
        if not buckets:
            raise ValueError("buckets is empty; pass None for a single bucket with every arm.")
        expected_lo = 1
        for b in buckets:
            if expected_lo is None or b.lo != expected_lo:
                raise ValueError(
                    f"Bucket {b.lo}..{b.hi} breaks the cover: buckets must be contiguous from "
                    f"batch 1 (expected lo={expected_lo})."
                )
            unknown = [a.name for a in b.arms if a not in self.arms]
            if unknown:
                raise ValueError(f"Bucket {b.lo}..{b.hi} lists arms {unknown} not in arms.")
            expected_lo = None if b.hi is None else b.hi + 1
        return buckets

    # -- selection ------------------------------------------------------------

    def bucket_index(self, batch_size: int) -> int:
        _check_int("batch_size", batch_size, 1)
        for i, b in enumerate(self.buckets):
            if b.contains(batch_size):
                return i
        last = self.buckets[-1]
        raise ValueError(
            f"batch_size {batch_size} is beyond the last bucket ({last.lo}..{last.hi}); "
            "end the last bucket with hi=None."
        )

    def eligible(self, batch_size: int) -> tuple[SpecArm, ...]:
        return self.buckets[self.bucket_index(batch_size)].arms

    def median_reward(self, arm: SpecArm, batch_size: int) -> float | None:
        """Median of the arm's windowed rewards in ``batch_size``'s bucket (None if unplayed)."""
        window = self._rewards[self.bucket_index(batch_size)][self._arm_index(arm)]
        return statistics.median(window) if window else None

    def select(self, batch_size: int) -> tuple[SpecArm, str]:
        """Pick the config for a step with ``batch_size`` live sequences; returns (arm, reason)."""
        bi = self.bucket_index(batch_size)
        eligible = self.buckets[bi].arms
        untried = [a for a in eligible if self._counts[bi][self._index[a]] < self.min_plays]
        if untried:
            arm, reason = untried[0], "untried"
        elif self._rng.random() < self.epsilon:
            arm, reason = eligible[self._rng.randrange(len(eligible))], "explore"
        else:
            arm, reason = self._best(bi, eligible), "exploit"
        self.step += 1
        self._pending = {"step": self.step, "batch_size": batch_size, "arm": arm.name,
                         "reason": reason, "reward": None}
        return arm, reason

    def _best(self, bi: int, eligible: Sequence[SpecArm]) -> SpecArm:
        medians = [statistics.median(self._rewards[bi][self._index[a]]) for a in eligible]
        return eligible[max(range(len(eligible)), key=lambda i: (medians[i], -i))]

    def update(self, arm: SpecArm, reward: float, batch_size: int | None = None) -> None:
        """Record the reward (see :func:`accepted_tokens_per_second`) of a played arm.

        ``batch_size`` defaults to the one of the last :meth:`select`.
        """
        reward = _check_float("reward", reward, lo=0.0, lo_open=False)
        ai = self._arm_index(arm)
        if batch_size is None:
            if self._pending is None:
                raise ValueError("update() without batch_size needs a preceding select().")
            batch_size = self._pending["batch_size"]
        bi = self.bucket_index(batch_size)
        self._rewards[bi][ai].append(reward)
        self._counts[bi][ai] += 1
        pending = self._pending
        if pending and pending["arm"] == arm.name and pending["batch_size"] == batch_size:
            self.history.append({**pending, "reward": reward})
            self._pending = None
        else:
            self.history.append({"step": self.step, "batch_size": batch_size, "arm": arm.name,
                                 "reason": "external", "reward": reward})

    def _arm_index(self, arm: SpecArm) -> int:
        try:
            return self._index[arm]
        except KeyError:
            known = [a.name for a in self.arms]
            raise ValueError(f"Unknown arm {arm!r}; known: {known}.") from None

    def counts(self) -> dict[str, dict[str, int]]:
        """Plays per bucket and arm, for logging: ``{"1-8": {"k3": 12, ...}, ...}``."""
        return {
            self._bucket_name(b): {a.name: self._counts[bi][self._index[a]] for a in b.arms}
            for bi, b in enumerate(self.buckets)
        }

    @staticmethod
    def _bucket_name(b: BatchBucket) -> str:
        return f"{b.lo}-{'inf' if b.hi is None else b.hi}"

    # -- checkpointing --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain lists/ints/floats (JSON- and torch.save-friendly) for Lightning checkpoints."""
        version, internal, gauss = self._rng.getstate()
        return {
            "arms": [a.num_speculative_tokens for a in self.arms],
            "buckets": [
                [b.lo, b.hi, [a.num_speculative_tokens for a in b.arms]] for b in self.buckets
            ],
            "epsilon": self.epsilon,
            "window": self.window,
            "rewards": [[list(w) for w in row] for row in self._rewards],
            "counts": [list(row) for row in self._counts],
            "step": self.step,
            "rng_state": [version, list(internal), gauss],
            "pending": None if self._pending is None else dict(self._pending),
            "history": [dict(h) for h in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the learned state; arms and buckets must match this selector's.

        ``epsilon``, ``window`` and ``min_plays`` stay as configured (a resumed run may change
        them; windows keep their newest ``window`` rewards).
        """
        mine = self.state_dict()
        for key in ("arms", "buckets"):
            if [list(x) if isinstance(x, (list, tuple)) else x for x in state[key]] != mine[key]:
                raise ValueError(
                    f"Checkpoint {key} {state[key]} differ from this selector's {mine[key]}; "
                    "build the selector with the same speculation.bandit.arms and buckets."
                )
        self._rewards = [[deque(w, maxlen=self.window) for w in row] for row in state["rewards"]]
        self._counts = [list(row) for row in state["counts"]]
        self.step = int(state["step"])
        version, internal, gauss = state["rng_state"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._pending = None if state["pending"] is None else dict(state["pending"])
        self.history = deque((dict(h) for h in state["history"]), maxlen=self.history.maxlen)


# ------------------------------------------------------------------ calibration


CALIBRATION_DEFINITION = (
    "verify_budget = the ridge point floor / slope: `floor` is the fastest measured step (the "
    "fixed, memory- or overhead-bound cost every forward pays), `slope` the cost of one more token "
    "fitted over the largest `fit_points` counts (the compute-bound regime). Below C tokens a step "
    "costs less than twice the floor, so verifying extra tokens there is nearly free."
)


@dataclass
class CalibrationResult:
    """Outcome of :func:`calibrate_verify_budget`, with the raw measurements."""

    verify_budget: int
    floor_s: float
    slope_s_per_token: float
    token_counts: list[int]
    times_s: list[float]
    per_token_s: list[float]
    compute_bound_reached: bool  # False: some fitted counts lie below C, so the slope may be too low
    definition: str = CALIBRATION_DEFINITION
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationResult:
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        """Write JSON (the caller picks the run directory)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CalibrationResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _check_token_counts(token_counts: Iterable[int]) -> list[int]:
    counts = list(token_counts)
    for n in counts:
        _check_int("token_counts entry", n, 1)
    if len(counts) < 3 or len(set(counts)) != len(counts):
        raise ValueError(
            f"token_counts needs >= 3 distinct positive counts, got {counts}; "
            "e.g. powers of two from 1 to well past the expected budget."
        )
    return sorted(counts)


def calibrate_verify_budget(
    measure: Callable[[int], float],
    token_counts: Iterable[int],
    fit_points: int = 3,
) -> CalibrationResult:
    """Find ``C``, the tokens per target forward where the forward turns compute-bound.

    ``measure(n)`` returns seconds for one target forward over ``n`` tokens (``n = batch *
    (k + 1)`` during verification). The ridge point ``floor / slope`` is where the two
    asymptotes of the cost meet: a roofline ``max(floor, slope * n)`` (memory and compute
    overlap, as on GPUs) and an affine ``floor + slope * n`` (a fixed per-step overhead, as
    on CPUs) both give it. See ``CALIBRATION_DEFINITION``.
    """
    counts = _check_token_counts(token_counts)
    fit_points = _check_int("fit_points", fit_points, 2)
    times = []
    for n in counts:
        t = measure(n)
        _check_float(f"measure({n})", t, lo=0.0, lo_open=True, hint=" It must return seconds.")
        times.append(float(t))
    floor = min(times)
    xs, ys = counts[-fit_points:], times[-fit_points:]
    x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError(
            f"the forward's time does not grow over the largest counts {xs} (times {ys}): the sweep never "
            "reached the compute-bound regime. Extend token_counts to larger counts.")
    budget = max(1, round(floor / slope))
    return CalibrationResult(
        verify_budget=budget,
        floor_s=floor,
        slope_s_per_token=slope,
        token_counts=counts,
        times_s=times,
        per_token_s=[t / n for t, n in zip(times, counts)],
        compute_bound_reached=counts[-fit_points] >= budget,
    )


# -------------------------------------------------------------------- long tail


class LongTailPolicy:
    """Says when few enough sequences are live that idle capacity can train the draft.

    TLT's spot training: in the rollout's long tail a handful of long sequences hold the
    workers; below ``threshold`` live sequences the draft may take (pre-emptible) training
    steps, published at the next weight sync. ``max_steps`` caps spot steps per rollout.
    ``mode`` accepts YAML booleans too (YAML reads an unquoted ``off`` as False).
    """

    def __init__(
        self, threshold: int, mode: str | bool = "off", max_steps: int | None = None
    ) -> None:
        if isinstance(mode, bool):
            mode = "on" if mode else "off"
        if mode not in ("off", "on"):
            raise ValueError(f"speculation.long_tail.mode must be 'off' or 'on', got {mode!r}.")
        self.mode = mode
        self.threshold = _check_int(
            "speculation.long_tail.threshold", threshold, 1,
            " It is the live batch size below which spot training starts.",
        )
        self.max_steps = None if max_steps is None else _check_int(
            "speculation.long_tail.max_steps", max_steps, 0
        )

    def __repr__(self) -> str:
        return (
            f"LongTailPolicy(threshold={self.threshold}, mode={self.mode!r}, "
            f"max_steps={self.max_steps})"
        )

    def in_long_tail(self, live_batch_size: int) -> bool:
        """True while some, but fewer than ``threshold``, sequences are still generating."""
        _check_int("live_batch_size", live_batch_size, 0)
        return 0 < live_batch_size < self.threshold

    def should_train(self, live_batch_size: int, steps_taken: int = 0) -> bool:
        """Take one more spot draft step now? (``steps_taken`` in this rollout so far)."""
        _check_int("steps_taken", steps_taken, 0)
        if self.mode == "off" or not self.in_long_tail(live_batch_size):
            return False
        return self.max_steps is None or steps_taken < self.max_steps

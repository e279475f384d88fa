"""The rollout-engine protocol the trainer talks to, and the data it returns."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence, runtime_checkable

import torch


@dataclass
class SamplingConfig:
    n: int = 1
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0  # no EOS before this many tokens (calibration: fixed-length decoding)
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS: e.g. a chat model's end-of-turn token


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the engine's policy
    finished: bool  # hit EOS (True) or max_tokens (False)


@dataclass
class SpecDecodeCounters:
    """Cumulative speculative-decoding counters; subtract two snapshots for a step's delta."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def _combine(self, other: "SpecDecodeCounters", sign: int) -> "SpecDecodeCounters":
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda v: list(v) + [0] * (width - len(v))  # noqa: E731
        return SpecDecodeCounters(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            [a + sign * b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
        )

    def __sub__(self, other: "SpecDecodeCounters") -> "SpecDecodeCounters":
        return self._combine(other, -1)

    def __add__(self, other: "SpecDecodeCounters") -> "SpecDecodeCounters":
        """Two engines' counters together (a multi-engine rollout sums its engines')."""
        return self._combine(other, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted/drafts: tokens produced per target forward; 1.0 when nothing was drafted."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_position_rates(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]


@dataclass
class LoadStats:
    """How crowded the engine was since the last `take_load_stats()`."""

    preemptions: int = 0  # sequences evicted from the KV cache (recomputed later: slow)
    max_running: int = 0  # most sequences decoded in one engine step
    max_waiting: int = 0  # most sequences queued behind them


@dataclass
class ProbeResult:
    """What `RolloutEngine.verify_weights` found: does the engine serve the weights it was sent?"""

    worst: float  # largest relative error over the probed tensors
    mismatches: list[str]  # "name: why" for each tensor out of tolerance or not served

    @property
    def ok(self) -> bool:
        return not self.mismatches


NamedTensors = Iterable[tuple[str, torch.Tensor]]
Sampling = SamplingConfig | Sequence[SamplingConfig]  # one for every prompt, or one per prompt (e.g. its seed)


def per_prompt(sampling: Sampling, num_prompts: int) -> list[SamplingConfig]:
    """One config per prompt from `sampling`."""
    configs = [sampling] * num_prompts if isinstance(sampling, SamplingConfig) else list(sampling)
    if len(configs) != num_prompts:
        raise ValueError(f"{len(configs)} sampling configs for {num_prompts} prompts; pass one, or one per prompt")
    return configs


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generation backend."""

    policy_version: int
    draft_version: int

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]: ...

    def sync_policy(self, weights: NamedTensors, version: int) -> None: ...

    def sync_draft(self, weights: NamedTensors, version: int) -> None: ...

    def spec_decode_counters(self) -> SpecDecodeCounters: ...

    def take_load_stats(self) -> LoadStats: ...

    def verify_weights(self, weights: NamedTensors, which: str, rtol: float) -> ProbeResult: ...

    def disable_speculation(self) -> None: ...

    def sleep(self) -> None:
        """Free the engine's accelerator memory while the trainer trains (`rollout.enable_sleep_mode`)."""
        ...

    def wake_up(self) -> bool:
        """Undo `sleep` before the weight sync; whether the engine had slept."""
        ...

    def without_speculation(self) -> AbstractContextManager[None]:
        """Plain decoding inside the block; the speculation schedule as it was after it."""
        ...

    def shutdown(self) -> None: ...

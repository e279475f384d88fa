"""Which rank serves which prompts: one rollout engine per tensor-parallel group of ranks.

With W ranks and T = `rollout.tensor_parallel_size`, ranks `[e*T, (e+1)*T)` form engine e (W / T
engines; T = W is one engine over every rank). Engine e serves a contiguous share of the step's
prompts, so a GRPO group never spans two engines; every rank of a TP group submits the same
requests (vLLM's TP ranks must), and the leader (the group's first rank) reports them. Each
request carries its own seed, drawn from (seed, purpose, step, global prompt index), and vLLM
gives sample j of a request the seed + j: the rollout is the same whether one engine served it
or eight. Completions and counters are gathered over the default process group, so every rank
ends up with the whole rollout, as a one-engine run has it.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch.distributed as dist

from spectrain.rollout.engine import Completion, LoadStats, SamplingConfig, SpecDecodeCounters


@dataclass(frozen=True)
class EngineLayout:
    num_engines: int
    tp_size: int
    rank: int = 0

    def __post_init__(self) -> None:
        assert self.num_engines >= 1 and self.tp_size >= 1 and self.rank >= 0, self

    @classmethod
    def single(cls) -> EngineLayout:
        """One engine in this process (one process, or the torch engine on rank 0)."""
        return cls(1, 1, 0)

    @property
    def engine_index(self) -> int | None:
        """The engine this rank belongs to; None for a rank that holds none (only the torch engine leaves some)."""
        index = self.rank // self.tp_size
        return index if index < self.num_engines else None

    @property
    def ranks_with_engines(self) -> int:
        return self.num_engines * self.tp_size

    @property
    def has_engine(self) -> bool:
        return self.engine_index is not None

    @property
    def is_leader(self) -> bool:
        """The first rank of its engine: it reports the engine's completions and counters (every rank of it probes
        its own shards of the weights)."""
        return self.has_engine and self.rank % self.tp_size == 0

    def prompt_range(self, num_prompts: int, engine: int | None = None) -> range:
        """Engine `engine`'s (default: this rank's) contiguous share of `num_prompts` prompts; shares differ by
        at most one prompt and cover every prompt once."""
        e = self.engine_index if engine is None else engine
        if e is None:
            return range(0)
        return range(e * num_prompts // self.num_engines, (e + 1) * num_prompts // self.num_engines)

    def gather(self, local):
        """Every engine leader's `local`, in engine order, on every rank (collective when there are ranks)."""
        everything = self.gather_every_rank((self.engine_index, local) if self.is_leader else None)
        by_engine = dict(item for item in everything if item is not None)
        assert sorted(by_engine) == list(range(self.num_engines)), (sorted(by_engine), self)
        return [by_engine[e] for e in range(self.num_engines)]

    def gather_every_rank(self, local) -> list:
        """Every rank's `local`, in rank order, on every rank (collective when there are ranks)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [local]
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, local)
        return everything


def request_seed(seed: int, purpose: str, step: int, prompt_index: int) -> int:
    """The seed of global prompt `prompt_index`'s request; vLLM seeds its sample j with this + j."""
    return zlib.crc32(f"{seed}:{purpose}:{step}:{prompt_index}".encode()) & 0x3FFFFFFF


def seeded_configs(sampling: SamplingConfig | list[SamplingConfig], prompts: range, seed: int, purpose: str,
                   step: int) -> list[SamplingConfig]:
    """One config per prompt of `prompts` (global indices), each with its request seed. `sampling` is one config
    for every prompt, or a list of one per global prompt (e.g. per-prompt `max_tokens`)."""
    def config(p: int) -> SamplingConfig:
        return sampling[p] if isinstance(sampling, list) else sampling

    return [replace(config(p), seed=request_seed(seed, purpose, step, p)) for p in prompts]


@dataclass
class EngineRollout:
    """What one engine generated for its share of a rollout (prompt indices already global)."""

    completions: list[Completion]
    spec: SpecDecodeCounters
    load: LoadStats
    seconds: float


@dataclass
class GatheredRollout:
    """Every engine's share, put together: the rollout as one engine would have returned it."""

    completions: list[Completion]
    spec: SpecDecodeCounters  # summed over the engines (each counted once, by its leader)
    load: LoadStats  # preemptions summed; the peaks are the largest engine's
    seconds: float  # the slowest engine's: the rollout is done when every engine is
    per_engine_acceptance: list[float]  # of the engines that had prompts


def merge(parts: list[EngineRollout]) -> GatheredRollout:
    spec = SpecDecodeCounters()
    for part in parts:
        spec = spec + part.spec
    load = LoadStats(sum(p.load.preemptions for p in parts), max(p.load.max_running for p in parts),
                     max(p.load.max_waiting for p in parts))
    return GatheredRollout([c for p in parts for c in p.completions], spec,
                           load, max(p.seconds for p in parts),
                           [p.spec.mean_acceptance_length for p in parts if p.completions])

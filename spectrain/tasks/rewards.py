"""Verifiable rewards for GRPO: compare a completion's final answer with the reference."""

from __future__ import annotations

import functools
import re
from typing import Callable

RewardFn = Callable[[str, str], float]

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


REWARD_FNS: dict[str, Callable[..., float]] = {"exact_answer": exact_answer_reward}


def get_reward_fn(name: str, **options) -> RewardFn:
    """Look up a reward by name and bind its options; bad names or options fail here, not mid-run."""
    if name not in REWARD_FNS:
        valid = ", ".join(sorted(REWARD_FNS))
        raise ValueError(f"unknown reward function {name!r}; valid names: {valid}")
    fn = functools.partial(REWARD_FNS[name], **options)
    try:
        fn("", "")  # a dry call validates the option names and values now
    except TypeError as err:
        raise ValueError(f"bad options {sorted(options)} for reward {name!r}: {err}") from None
    return fn

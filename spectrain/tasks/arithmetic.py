"""Synthetic multi-digit addition with a worked answer: the default recipe's verifiable task.

Format (digits=3, operands=2)::

    prompt  "047+385="
    target  "7+5+0=12,4+8+1=13,0+3+1=04;432"

Operands are zero-padded to `digits` and the worked answer adds one column per step, ones
first: the column's digits, the carry in, then the two-digit column sum (its first digit is
the next carry). Every width is fixed, so each character a step needs sits at a constant
distance behind it, which a tiny RoPE model picks up in minutes of SFT. The final answer
after `;` must be read back in reverse and stripped of leading zeros, which the model learns
last, leaving room for RL to improve it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from spectrain.tasks.rewards import ANSWER_MARKER

MAX_OPERANDS = 10  # keeps every column sum (at most 10 * operands - 1) at two digits


@dataclass(frozen=True)
class Example:
    """One prompt; `answer` is what the reward checks, `target` the SFT completion if known.

    A prompt from a file may be chat messages, a tuple of `{role, content}` dicts: equality
    works, hashing does not.
    """

    prompt: str | tuple[dict[str, str], ...]
    answer: str
    target: str | None = None


class ArithmeticTask:
    """Sums of `operands` numbers of up to `digits` digits each, deterministic by `seed`."""

    def __init__(self, digits: int = 3, operands: int = 2, seed: int = 0) -> None:
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        if not 2 <= operands <= MAX_OPERANDS:
            raise ValueError(f"operands must be in [2, {MAX_OPERANDS}], got {operands}")
        self.digits, self.operands = digits, operands
        self._rng = random.Random(seed)

    def sample(self, n: int, rng: random.Random | None = None) -> list[Example]:
        """Draw `n` problems from `rng`, or from the task's own seeded stream when omitted."""
        rng = self._rng if rng is None else rng
        upper = 10**self.digits
        return [
            self.example([rng.randrange(upper) for _ in range(self.operands)]) for _ in range(n)
        ]

    def example(self, numbers: Sequence[int]) -> Example:
        """The prompt, answer and worked target for a given list of operands."""
        if len(numbers) != self.operands or not all(0 <= x < 10**self.digits for x in numbers):
            raise ValueError(
                f"need {self.operands} integers in [0, {10**self.digits}), got {list(numbers)}"
            )
        prompt = "+".join(f"{x:0{self.digits}d}" for x in numbers) + "="
        answer = str(sum(numbers))
        return Example(prompt, answer, self._worked(numbers) + ANSWER_MARKER + answer)

    @property
    def max_target_chars(self) -> int:
        """Longest target in characters, to size generation limits (`max_tokens`)."""
        target = self.example([10**self.digits - 1] * self.operands).target
        assert target is not None  # example() always writes the worked target
        return len(target)

    def _worked(self, numbers: Sequence[int]) -> str:
        steps, carry = [], 0
        for column in range(self.digits):
            column_digits = [(x // 10**column) % 10 for x in numbers]
            total = sum(column_digits) + carry
            steps.append("+".join(map(str, [*column_digits, carry])) + f"={total:02d}")
            carry = total // 10
        return ",".join(steps)

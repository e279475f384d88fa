"""Prompt sources for GRPO: the synthetic task or a JSONL file of prompts with answers.

A source only has to draw examples (`sample(n, rng)`), so `ArithmeticTask` is one as is.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Literal, Protocol

from spectrain.tasks.arithmetic import ArithmeticTask, Example
from spectrain.tasks.tokenizer import CHARSET, CharTokenizer

OnBadRow = Literal["skip", "error"]
_SHOWN_BAD_ROWS = 5  # a summary, not a dump of a broken file
_ROW_HINT = 'each line must be a JSON object like {"prompt": "12+34=", "answer": "46"}'


class PromptSource(Protocol):
    def sample(self, n: int, rng: random.Random | None = None) -> list[Example]:
        """Draw `n` examples; the same `rng` state gives the same examples."""
        ...


class PromptFileError(ValueError):
    """A prompt file that cannot be used as configured; the message says how to fix it."""


class _BadRow(ValueError):
    pass


class JsonlPrompts:
    """Examples from a JSONL file (`{"prompt", "answer"[, "target"]}` per line).

    `target` is the worked completion the SFT warm start teaches; a row without one is
    warm-started on its answer.
    """

    def __init__(
        self,
        path: str | Path,
        on_bad_row: OnBadRow = "error",
        tokenizer: CharTokenizer | None = None,
        seed: int = 0,
    ) -> None:
        self.examples = load_jsonl_examples(path, on_bad_row, tokenizer)
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self):
        return iter(self.examples)

    def sample(self, n: int, rng: random.Random | None = None) -> list[Example]:
        """No repeats within a call (whole shuffled passes when `n` exceeds the file).

        A pure function of `rng`, so a resumed run that re-seeds per step draws the same prompts.
        """
        rng = self._rng if rng is None else rng
        size = len(self.examples)
        passes, rest = divmod(n, size)
        order = [i for _ in range(passes) for i in rng.sample(range(size), size)]
        order += rng.sample(range(size), rest)
        return [self.examples[i] for i in order]


def load_jsonl_examples(
    path: str | Path, on_bad_row: OnBadRow = "error", tokenizer: CharTokenizer | None = None
) -> list[Example]:
    """Read `{"prompt", "answer"[, "target"]}` rows; bad rows are skipped or fatal per `on_bad_row`."""
    if on_bad_row not in ("skip", "error"):
        raise ValueError(f"on_bad_row must be 'skip' or 'error', got {on_bad_row!r}")
    path = Path(path)
    tokenizer = tokenizer or CharTokenizer()
    examples, bad = [], []
    for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue  # blank lines (e.g. a trailing newline) are not rows
        try:
            examples.append(_parse_row(raw, tokenizer))
        except _BadRow as err:
            bad.append(f"{path}:{lineno}: {err}")
    if not examples:
        detail = f" ({len(bad)} bad rows):\n{_summary(bad)}" if bad else " (the file is empty)"
        raise PromptFileError(f"no valid rows in {path}{detail}\n{_ROW_HINT}")
    if bad and on_bad_row == "error":
        raise PromptFileError(
            f"{len(bad)} bad rows in {path}:\n{_summary(bad)}\n"
            f"Fix them, or set on_bad_row='skip' to drop them with a warning."
        )
    if bad:
        warnings.warn(
            f"skipped {len(bad)} of {len(bad) + len(examples)} rows in {path}:\n{_summary(bad)}",
            stacklevel=2,
        )
    return examples


def _summary(bad: list[str]) -> str:
    lines = [f"  {msg}" for msg in bad[:_SHOWN_BAD_ROWS]]
    if len(bad) > _SHOWN_BAD_ROWS:
        lines.append(f"  ... and {len(bad) - _SHOWN_BAD_ROWS} more")
    return "\n".join(lines)


def _parse_row(raw: bytes, tokenizer: CharTokenizer) -> Example:
    try:
        row = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise _BadRow("not valid UTF-8; save the file as UTF-8") from None
    except json.JSONDecodeError as err:
        raise _BadRow(f"invalid JSON ({err.msg} at column {err.colno}); {_ROW_HINT}") from None
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {type(row).__name__}; {_ROW_HINT}")
    missing = [key for key in ("prompt", "answer") if key not in row]
    if missing:
        raise _BadRow(f"missing key(s) {', '.join(map(repr, missing))}; {_ROW_HINT}")
    fields = {key: row[key] for key in ("prompt", "answer", "target") if key in row}
    for key, value in fields.items():
        _check_field(key, value, tokenizer)
    return Example(**fields)


def _check_field(key: str, value: object, tokenizer: CharTokenizer) -> None:
    if not isinstance(value, str):
        raise _BadRow(
            f"{key!r} must be a string, got {type(value).__name__}; "
            f'write it in quotes, e.g. "{key}": "46"'
        )
    if not value.strip():
        raise _BadRow(f"{key!r} is empty; give it text or remove the row")
    unknown = tokenizer.unknown_chars(value)
    if unknown:
        raise _BadRow(
            f"{key!r} has characters the tokenizer cannot encode: {''.join(unknown)!r}; "
            f"use only these characters: {CHARSET!r}"
        )


def build_prompt_source(kind: str, **options) -> PromptSource:
    """The source a recipe names: "arithmetic" (ArithmeticTask) or "jsonl" (JsonlPrompts)."""
    sources = {"arithmetic": ArithmeticTask, "jsonl": JsonlPrompts}
    if kind not in sources:
        raise ValueError(f"unknown prompt source {kind!r}; valid kinds: {', '.join(sources)}")
    return sources[kind](**options)

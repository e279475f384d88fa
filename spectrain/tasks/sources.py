"""Prompt sources for GRPO: the synthetic task or prompt files (JSONL, JSON or parquet) with answers.

A source only has to draw examples (`sample(n, rng)`), so `ArithmeticTask` is one as is.
File keys follow verl's: a prompt is a string or a list of chat messages, keys may be
dotted paths into nested rows (`reward_model.ground_truth`), and rows whose prompt is too
long are dropped and counted up front rather than failing mid-run.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, Protocol

from spectrain.tasks.arithmetic import ArithmeticTask, Example
from spectrain.tasks.tokenizer import CHARSET, CharTokenizer, Prompt, PromptTokenizer

OnBadRow = Literal["skip", "error"]
_SHOWN_BAD_ROWS = 5  # a summary, not a dump of a broken file
_ROW_HINT = 'each row must be an object like {"prompt": "12+34=", "answer": "46"}'
_SHOWN_KEYS = 20


class PromptSource(Protocol):
    def sample(self, n: int, rng: random.Random | None = None) -> list[Example]:
        """Draw `n` examples; the same `rng` state gives the same examples."""
        ...


class PromptFileError(ValueError):
    """A prompt file that cannot be used as configured; the message says how to fix it."""


class _BadRow(ValueError):
    pass


class FilePrompts:
    """Examples from JSONL (`.jsonl`: one object a line), JSON (`.json`: an array of objects, or JSON lines) and
    parquet files.

    `target` is the worked completion the SFT warm start teaches; a row without one is
    warm-started on its answer. `prompt_template` wraps string prompts (`{prompt}` is
    replaced literally, so other braces such as `\\boxed{}` are kept). Rows dropped for
    `max_prompt_length` and bad rows skipped are counted in `dropped_overlong` and
    `skipped_bad` (and warned about).
    """

    def __init__(
        self,
        files: str | Path | list[str | Path],
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        target_key: str = "target",
        prompt_template: str | None = None,
        max_prompt_length: int | None = None,
        filter_overlong_prompts: bool = True,
        on_bad_row: OnBadRow = "skip",
        tokenizer: PromptTokenizer | None = None,
        seed: int = 0,
    ) -> None:
        if on_bad_row not in ("skip", "error"):
            raise ValueError(f"data.on_bad_row must be 'skip' or 'error', got {on_bad_row!r}")
        if prompt_template is not None and "{prompt}" not in prompt_template:
            raise PromptFileError(f"data.prompt_template {prompt_template!r} has no {{prompt}} placeholder; "
                                  f"write it where the prompt goes, e.g. '{{prompt}} Think step by step.'")
        self._keys = {"prompt": prompt_key, "answer": answer_key, "target": target_key}
        self._template = prompt_template
        self._tokenizer = tokenizer or CharTokenizer()
        self.skipped_bad = self.dropped_overlong = 0
        self.examples = []
        for path in map(Path, _as_paths(files)):
            rows = self._load(path, on_bad_row)
            if max_prompt_length is not None:
                rows = self._drop_overlong(path, rows, max_prompt_length, filter_overlong_prompts)
            self.examples += [ex for _, ex in rows]
        _check_chat_support(self.examples, self._tokenizer)
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def sample(self, n: int, rng: random.Random | None = None) -> list[Example]:
        """No repeats within a call (whole shuffled passes when `n` exceeds the rows).

        A pure function of `rng`, so a resumed run that re-seeds per step draws the same prompts.
        """
        rng = self._rng if rng is None else rng
        size = len(self.examples)
        passes, rest = divmod(n, size)
        order = [i for _ in range(passes) for i in rng.sample(range(size), size)]
        order += rng.sample(range(size), rest)
        return [self.examples[i] for i in order]

    def _load(self, path: Path, on_bad_row: OnBadRow) -> list[tuple[str, Example]]:
        """One file's `(where, example)` rows; bad rows are skipped (counted) or fatal per `on_bad_row`."""
        examples: list[tuple[str, Example]] = []
        bad: list[str] = []
        found: set[str] = set()
        first_row = None
        for where, row in _read_rows(path):
            first_row = row if first_row is None and isinstance(row, dict) else first_row
            try:
                examples.append((where, self._parse_row(row, found)))
            except _BadRow as err:
                bad.append(f"{path}:{where}: {err}")
        if first_row is not None:
            self._check_keys_exist(path, found, first_row)
        if not examples:
            detail = f" ({len(bad)} bad rows):\n{_summary(bad)}" if bad else " (the file is empty)"
            raise PromptFileError(f"no valid rows in {path}{detail}\n{_ROW_HINT}")
        if bad and on_bad_row == "error":
            raise PromptFileError(f"{len(bad)} bad rows in {path}:\n{_summary(bad)}\n"
                                  f"Fix them, or set data.on_bad_row=skip to drop them with a warning.")
        if bad:
            self.skipped_bad += len(bad)
            warnings.warn(f"skipped {len(bad)} of {len(bad) + len(examples)} rows in {path}:\n{_summary(bad)}",
                          stacklevel=3)
        return examples

    def _parse_row(self, row: object, found: set[str]) -> Example:
        """`found` collects the fields this row has, so a key no row has is a config error, not bad rows."""
        if isinstance(row, _BadRow):
            raise row
        if not isinstance(row, dict):
            raise _BadRow(f"expected an object, got {type(row).__name__}; {_ROW_HINT}")
        values = {field: _lookup(row, key) for field, key in self._keys.items()}
        found.update(field for field, value in values.items() if value is not _MISSING)
        missing = [self._keys[field] for field in ("prompt", "answer") if values[field] is _MISSING]
        if missing:
            raise _BadRow(f"missing key(s) {', '.join(map(repr, missing))}; {_ROW_HINT}")
        prompt = _check_prompt(self._keys["prompt"], values["prompt"])
        if isinstance(prompt, str) and self._template is not None:
            prompt = self._template.replace("{prompt}", prompt)
        answer = _check_text(self._keys["answer"], values["answer"])
        target = values["target"]
        target = None if target is _MISSING or target is None else _check_text(self._keys["target"], target)
        for key, text in ((self._keys["prompt"], prompt), (self._keys["answer"], answer),
                          (self._keys["target"], target)):
            self._check_encodable(key, text)
        return Example(prompt, answer, target)

    def _check_encodable(self, key: str, text: Prompt | None) -> None:
        """Only the character tokenizer has a charset; a real tokenizer encodes any text."""
        unknown_chars = getattr(self._tokenizer, "unknown_chars", None)
        unknown = unknown_chars(text) if unknown_chars and isinstance(text, str) else None
        if unknown:
            raise _BadRow(f"{key!r} has characters the tokenizer cannot encode: {''.join(unknown)!r}; "
                          f"use only these characters: {CHARSET!r}")

    def _check_keys_exist(self, path: Path, found: set[str], first_row: dict) -> None:
        for field, config_key in (("prompt", "data.prompt_key"), ("answer", "data.answer_key")):
            if field not in found:
                keys = _key_paths(first_row)
                shown = ", ".join(keys[:_SHOWN_KEYS]) + (", ..." if len(keys) > _SHOWN_KEYS else "")
                raise PromptFileError(
                    f"{config_key}: no row of {path} has the key {self._keys[field]!r}; its rows have: {shown}. "
                    f"Set {config_key} to one of them (dotted for nested keys, e.g. reward_model.ground_truth)")

    def _drop_overlong(self, path: Path, rows: list[tuple[str, Example]], max_prompt_length: int,
                       filter_overlong: bool) -> list[tuple[str, Example]]:
        """Rows whose prompt (chat template included) fits; longer ones are dropped and counted, or fatal."""
        kept = []
        for where, ex in rows:
            length = len(self._tokenizer.encode_prompt(ex.prompt))
            if length <= max_prompt_length:
                kept.append((where, ex))
            elif not filter_overlong:
                raise PromptFileError(
                    f"{path}:{where}: the prompt has {length} tokens, more than data.max_prompt_length="
                    f"{max_prompt_length}; raise data.max_prompt_length or set data.filter_overlong_prompts=true "
                    f"to drop such rows")
        if not kept:
            raise PromptFileError(f"every prompt in {path} is longer than data.max_prompt_length="
                                  f"{max_prompt_length} tokens; raise data.max_prompt_length")
        dropped = len(rows) - len(kept)
        if dropped:
            self.dropped_overlong += dropped
            warnings.warn(f"dropped {dropped} of {len(rows)} rows in {path} whose prompt is longer than "
                          f"data.max_prompt_length={max_prompt_length} tokens", stacklevel=3)
        return kept


_MISSING = object()


def _as_paths(files: str | Path | list[str | Path]) -> list[str | Path]:
    paths = [files] if isinstance(files, (str, Path)) else list(files)
    if not paths:
        raise PromptFileError("no prompt files given; set data.train_files to a .jsonl, .json or .parquet path")
    return paths


def _read_rows(path: Path) -> Iterator[tuple[str, object]]:
    """`(where, row)` pairs: a line number for JSON lines, `[i]` for a JSON array, `row N` for parquet; a line that
    is not JSON comes as a `_BadRow`, so the bad-row accounting reports it with its line number."""
    if path.is_dir():
        raise PromptFileError(f"cannot read {path}: it is a directory; give a .jsonl, .json or .parquet file (or a "
                              f"list)")
    if path.suffix == ".parquet":
        yield from ((f"row {i}", row) for i, row in enumerate(_read_parquet(path), start=1))
    elif path.suffix == ".jsonl":
        yield from _json_lines(path.read_bytes())
    elif path.suffix == ".json":
        yield from _read_json(path)
    else:
        raise PromptFileError(f"{path}: unknown file type {path.suffix!r}; use .jsonl (one JSON object a line), "
                              f".json (a JSON array of objects, or JSON lines) or .parquet")


def _json_lines(data: bytes) -> list[tuple[str, object]]:
    """Blank lines (e.g. a trailing newline) are not rows."""
    return [(str(lineno), _decode_json_line(raw)) for lineno, raw in enumerate(data.splitlines(), start=1)
            if raw.strip()]


def _read_json(path: Path) -> list[tuple[str, object]]:
    """A `.json` file's rows, whichever it holds: one JSON array of rows, or JSON lines."""
    data = path.read_bytes()
    try:
        whole = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        whole = err
    if isinstance(whole, list):
        return [(f"[{i}]", row) for i, row in enumerate(whole)]
    rows = _json_lines(data)
    if rows and all(isinstance(row, _BadRow) for _, row in rows):  # no line is JSON: the file is neither
        held = "it holds one JSON object" if isinstance(whole, dict) else f"invalid JSON: {whole}"
        raise PromptFileError(f"{path} is neither a JSON array of rows nor JSON lines ({held}); give "
                              f"[{{\"prompt\": ..., \"answer\": ...}}, ...] or one such object a line")
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptFileError(f"{path}: reading parquet needs pyarrow; pip install pyarrow") from None
    try:
        return pq.read_table(path).to_pylist()
    except OSError:
        raise
    except Exception as err:  # pyarrow's ArrowInvalid and kin: the file is not parquet
        raise PromptFileError(f"{path}: not a readable parquet file ({err})") from None


def _decode_json_line(raw: bytes) -> object:
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        return _BadRow("not valid UTF-8; save the file as UTF-8")
    except json.JSONDecodeError as err:
        return _BadRow(f"invalid JSON ({err.msg} at column {err.colno}); {_ROW_HINT}")


def _lookup(row: dict, key: str) -> object:
    """`row[key]`, else the dotted path `a.b.c` through nested objects; `_MISSING` when absent."""
    if key in row:
        return row[key]
    value: object = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _key_paths(row: dict, prefix: str = "") -> list[str]:
    """Every key of a row, nested ones dotted, to show what `data.*_key` may name."""
    paths = []
    for key, value in row.items():
        paths.append(prefix + key)
        if isinstance(value, dict):
            paths += _key_paths(value, f"{prefix}{key}.")
    return paths


def _check_prompt(key: str, value: object) -> str | tuple[dict[str, str], ...]:
    """A string, or chat messages as a tuple of `{role, content}` dicts (a tuple: examples are frozen)."""
    if isinstance(value, list):
        if value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                         and isinstance(m.get("content"), str) for m in value):
            return tuple({"role": m["role"], "content": m["content"]} for m in value)
        raise _BadRow(f"{key!r} is a list but not of chat messages; write "
                      f'[{{"role": "user", "content": "..."}}, ...] or a string')
    if not isinstance(value, str):
        raise _BadRow(f"{key!r} must be a string or a list of chat messages, got {type(value).__name__}")
    if not value.strip():
        raise _BadRow(f"{key!r} is empty; give it text or remove the row")
    return value


def _check_text(key: str, value: object) -> str:
    """A string; numbers (common for answers) become their text, `72.0` as `72`."""
    if isinstance(value, bool):
        raise _BadRow(f"{key!r} must be a string or a number, got bool")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, float)):
        value = str(value)
    if not isinstance(value, str):
        raise _BadRow(f"{key!r} must be a string or a number, got {type(value).__name__}; "
                      f'write it in quotes, e.g. "{key}": "46"')
    if not value.strip():
        raise _BadRow(f"{key!r} is empty; give it text or remove the row")
    return value


def _check_chat_support(examples: list[Example], tokenizer: PromptTokenizer) -> None:
    """Chat prompts need a chat template; encoding one now fails at load time, not mid-run."""
    chat = next((ex.prompt for ex in examples if not isinstance(ex.prompt, str)), None)
    if chat is not None:
        tokenizer.encode_prompt(chat)


def _summary(bad: list[str]) -> str:
    lines = [f"  {msg}" for msg in bad[:_SHOWN_BAD_ROWS]]
    if len(bad) > _SHOWN_BAD_ROWS:
        lines.append(f"  ... and {len(bad) - _SHOWN_BAD_ROWS} more")
    return "\n".join(lines)


def build_prompt_source(kind: str, **options) -> PromptSource:
    """The source a recipe names: "arithmetic" (ArithmeticTask) or "files" (FilePrompts)."""
    sources = {"arithmetic": ArithmeticTask, "files": FilePrompts}
    if kind not in sources:
        raise ValueError(f"unknown prompt source {kind!r}; valid kinds: {', '.join(sources)}")
    return sources[kind](**options)

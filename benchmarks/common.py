"""What every benchmark shares: `key=value` options and the summaries its reports print."""
from __future__ import annotations

import statistics
from typing import Callable

from spectrain.config import load_config
from spectrain.errors import ConfigError


def split_options(name: str, args: list[str], defaults: dict) -> tuple[dict, list[str]]:
    """Benchmark options (keys of `defaults`, converted to their type) and the remaining arguments.

    `name` only names the benchmark in the error a value of the wrong type raises.
    """
    options, rest = dict(defaults), []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in options:
            rest.append(arg)
            continue
        try:
            options[key] = type(defaults[key])(value)
        except ValueError:
            raise ConfigError(f"bench {name}: {key}={value!r}: expected {type(defaults[key]).__name__}, like the "
                              f"default {key}={defaults[key]}") from None
    return options, rest


def parse_options(name: str, args: list[str], defaults: dict) -> dict:
    """`split_options` for a benchmark that takes nothing else: any other argument is an error."""
    options, unknown = split_options(name, args, defaults)
    if unknown:
        raise ConfigError(f"bench {name}: unknown option(s) {' '.join(unknown)}; use key=value with key in "
                          f"{', '.join(sorted(defaults))}")
    return options


def recipe_options(name: str, args: list[str], defaults: dict, layouts: Callable[[dict], list[list[str]]],
                   min_steps: int = 2, why_steps: str = "the first is not timed") -> tuple[dict, list[str]]:
    """A recipe benchmark's options and recipe overrides, checked before any run.

    The first argument may name the recipe (`bench NAME RECIPE key=value ...`); every other argument that is not
    one of `defaults` is a recipe override. The recipe is loaded once with the overrides plus each of
    `layouts(options)` (the overrides of each run the benchmark makes, checked there), so a bad recipe, option or
    override fails here, not mid-study.
    """
    if args and "=" not in args[0]:
        args = [f"recipe={args[0]}", *args[1:]]
    options, overrides = split_options(name, args, defaults)
    rounds = options.get("rounds", 1)  # a benchmark without rounds makes one run per setting
    if options["steps"] < min_steps or rounds < 1:
        raise ConfigError(f"bench {name}: steps={options['steps']} rounds={rounds}: give steps >= {min_steps} "
                          f"({why_steps}) and rounds >= 1")
    runs = layouts(options)  # raises its own errors (a bad benchmark option)
    try:
        for layout in runs:
            load_config(options["recipe"], overrides + layout)
    except ConfigError as exc:
        raise ConfigError(f"bench {name}: {exc} (the benchmark's own options: {', '.join(defaults)})") from None
    return options, overrides


def int_list(name: str, key: str, text: str) -> list[int]:
    """`"1,2,4"` -> `[1, 2, 4]`, sorted: the sweep points of option `key`."""
    try:
        return sorted(int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"bench {name}: {key}={text!r} is not a comma-separated list of integers") from None


def summarize(values: list[float]) -> dict:
    """Median and spread of repeated measurements (`runs` kept for paired ratios)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def speed_word(ratio: float) -> str:
    """A speed ratio (above 1: faster) in words, so that a slowdown reads as one: `0.93x (1.07x slower)`."""
    word, factor = ("faster", ratio) if ratio >= 1 else ("slower", 1 / ratio)
    return f"{ratio:.2f}x ({factor:.2f}x {word})"


def paired_ratios(values: list[float], base: list[float]) -> dict:
    """`summarize` of the per-round ratios `values[i] / base[i]` (rounds measured side by side)."""
    return summarize([v / b for v, b in zip(values, base, strict=True)])

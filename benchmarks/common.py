"""What every benchmark shares: `key=value` options and the summaries its reports print."""
from __future__ import annotations

import statistics

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


def int_list(name: str, key: str, text: str) -> list[int]:
    """`"1,2,4"` -> `[1, 2, 4]`, sorted: the sweep points of option `key`."""
    try:
        return sorted(int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"bench {name}: {key}={text!r} is not a comma-separated list of integers") from None


def summarize(values: list[float]) -> dict:
    """Median and spread of repeated measurements (`runs` kept for paired ratios)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def paired_ratios(values: list[float], base: list[float]) -> dict:
    """`summarize` of the per-round ratios `values[i] / base[i]` (rounds measured side by side)."""
    return summarize([v / b for v, b in zip(values, base, strict=True)])

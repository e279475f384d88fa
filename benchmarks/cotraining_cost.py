"""`spectrain bench cotraining_cost RECIPE`: what each way of making draft co-training cheaper costs and keeps.

Runs the recipe with the draft co-trained in several ways (`VARIANTS`: an update every step, every 2nd or
4th step, only when acceptance drops (`draft.hold_tolerance`), fewer TTT passes (warmed up with as many: the
warm-up's cache is keyed by them), the chunked lm_head + loss), next to no speculation and a frozen draft, for
`steps` GRPO steps each, from one warm start and seed, in `rounds` interleaved rounds. Per variant it reports the
draft update's share of the step (all of the draft's seconds over all the step time, steps without an update
included), the updates per step, the mean acceptance length over the timed steps and over their second half
(where a draft that is updated less often would show staleness first), and the step speed against `every_step`
and `none` (medians of paired rounds).

Writes `cotraining_cost.json`, `cotraining_cost.md` and `cotraining_cost.png` under `out`.

Usage: `spectrain bench cotraining_cost [RECIPE] [steps=24] [rounds=2] [variants=...] [out=runs/bench_cotraining_cost]
[work=runs/bench_cotraining_cost] [key=value ...]` (any other key=value is a recipe override for every run).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from benchmarks.common import paired_ratios, recipe_options
from benchmarks.speedup import finite, mean_curve, ratio_text, round_order, run_one, timed, value_text
from spectrain.errors import ConfigError
from spectrain.machine import machine_label
from spectrain.plots import plot_panels

VARIANTS = {
    "none": ["draft.mode=none"],
    "frozen": ["draft.mode=frozen"],
    "every_step": ["draft.mode=cotrained"],
    "every_2": ["draft.mode=cotrained", "draft.every_n_steps=2"],
    "every_4": ["draft.mode=cotrained", "draft.every_n_steps=4"],
    "hold": ["draft.mode=cotrained", "draft.hold_tolerance=0.05"],
    "ttt_2": ["draft.mode=cotrained", "draft.ttt_passes=2"],
    "chunked": ["draft.mode=cotrained", "draft.loss_kernel=chunked"],
}
# the draft warm-up trains with draft.ttt_passes, and its cache is keyed by it: fewer passes warm up on their own
OWN_WARMSTART = ("ttt_2",)
REFERENCE = "every_step"  # the default co-training every variant is compared with
# `frozen` and `chunked` on request: the speedup benchmark compares frozen, and the chunked kernel saves memory at
# a large draft vocabulary, not time at a small one
DEFAULT_VARIANTS = ("none", "every_step", "every_2", "every_4", "hold", "ttt_2")
DEFAULTS = {"recipe": "tiny_cpu", "steps": 24, "rounds": 2, "variants": ",".join(DEFAULT_VARIANTS),
            "out": "runs/bench_cotraining_cost", "work": "runs/bench_cotraining_cost"}


def zero_if_nan(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def run_figures(run: dict) -> dict:
    """One run's cost and acceptance over its timed steps (the first step warms the engine up)."""
    p = run["per_step"]
    steps = timed(p, "time/step")
    draft = [zero_if_nan(d) for d in timed(p, "draft/seconds")]  # NaN: a step without a draft update
    acceptance = timed(p, "spec/mean_acceptance_length")
    late = finite(acceptance[len(acceptance) // 2:])
    return {"step_seconds": statistics.fmean(steps),
            "draft_share": sum(draft) / sum(steps),
            "updates_per_step": statistics.fmean(zero_if_nan(u) for u in timed(p, "draft/updated")),
            "acceptance_length": statistics.fmean(finite(acceptance)) if finite(acceptance) else None,
            "late_acceptance_length": statistics.fmean(late) if late else None,
            "reward": statistics.fmean(finite(p["reward"]))}


def summarise(runs: dict[str, list[dict]]) -> dict:
    rounds = min(len(r) for r in runs.values())
    figures = {v: [run_figures(r) for r in rs[:rounds]] for v, rs in runs.items()}
    per_variant = {v: {key: {"median": statistics.median(x), "min": min(x), "max": max(x)}
                       for key in fs[0] if None not in (x := [f[key] for f in fs])} for v, fs in figures.items()}
    step = {v: [f["step_seconds"] for f in fs] for v, fs in figures.items()}
    for v in per_variant:
        for base in ("none", REFERENCE):
            if base in step and v != base:  # above 1: the variant's step is faster
                per_variant[v][f"speed_over_{base}"] = paired_ratios(step[base], step[v])
    return {"rounds": rounds, "variants": per_variant}


def markdown(payload: dict) -> str:
    s, o = payload["summary"], payload["options"]
    rows = []
    for v, m in s["variants"].items():
        cell = lambda key, fmt=".2f", scale=1.0: value_text(m[key], fmt, scale) if key in m else "—"  # noqa: E731
        speed = lambda base: ratio_text(m[f"speed_over_{base}"]) if f"speed_over_{base}" in m else "—"  # noqa: E731
        rows.append(f"| {v} | `{' '.join(VARIANTS[v])}` | {cell('step_seconds')} | "
                    f"{cell('draft_share', '.0f', 100)}% | {cell('updates_per_step')} | {cell('acceptance_length')} | "
                    f"{cell('late_acceptance_length')} | "
                    f"{speed(REFERENCE)} | {speed('none')} |")
    return f"""# The cost of draft co-training, and what each cheaper variant keeps

`{payload['command']}` on {payload['machine']}: recipe `{o['recipe']}`, {o['steps']} GRPO steps per run (the first
not timed), {s['rounds']} interleaved rounds, one warm start and seed for every run.

Per variant, median over rounds (min..max): mean step time; the draft update's share of the step (its seconds over
all the step time, steps without an update included); draft updates per step; mean acceptance length over the
timed steps and over their second half; step speed over `{REFERENCE}` and over `none` (above 1: faster; median of
the rounds' paired ratios, min..max).

| variant | overrides | step s | draft share | updates / step | acceptance | acceptance, 2nd half | \
speed vs {REFERENCE} | speed vs none |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

![per-step time, draft seconds and acceptance by variant](cotraining_cost.png)
"""


def write_report(out: Path, runs: dict, options: dict, command: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(runs)
    payload = {"command": command, "machine": machine_label(), "options": options, "summary": summary, "runs": runs}
    (out / "cotraining_cost.json").write_text(json.dumps(payload, default=str) + "\n")
    series = lambda key, skip=(): {v: mean_curve(rs, key) for v, rs in runs.items() if v not in skip}  # noqa: E731
    plot_panels(out / "cotraining_cost.png", f"draft co-training variants on {options['recipe']} (mean over rounds)", [
        ("step seconds", series("time/step")),
        ("draft update seconds (gaps: no update)", series("draft/seconds", skip=("none", "frozen"))),
        ("mean acceptance length", series("spec/mean_acceptance_length", skip=("none",)))])
    (out / "cotraining_cost.md").write_text(markdown(payload))
    return summary


def chosen_variants(options: dict) -> list[str]:
    variants = [v for v in options["variants"].split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        raise ConfigError(f"bench cotraining_cost: variants={options['variants']!r}: unknown "
                          f"{', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    return variants


def parse(args: list[str]) -> tuple[dict, list[str]]:
    options, overrides = recipe_options(
        "cotraining_cost", args, DEFAULTS, lambda o: [VARIANTS[v] for v in chosen_variants(o)], min_steps=3,
        why_steps="the first is not timed, and the acceptance's second half needs a step")
    options["variants"] = ",".join(chosen_variants(options))
    return options, overrides


def main(args: list[str]) -> int:
    options, overrides = parse(args)
    variants = options["variants"].split(",")
    out, work = Path(options["out"]), Path(options["work"])
    command = " ".join(["spectrain bench cotraining_cost", *args])
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for round_index in range(options["rounds"]):
        for variant in round_order(variants, round_index):
            print(f"[bench cotraining_cost] round {round_index + 1}/{options['rounds']}: {variant}", flush=True)
            warmstart = work / (f"warmstart_{variant}" if variant in OWN_WARMSTART else "warmstart")
            run = run_one(options["recipe"], overrides + VARIANTS[variant], variant,
                          work / f"round{round_index}" / variant, warmstart, options["steps"])
            runs[variant].append({**run, "round": round_index})
        summary = write_report(out, runs, options, command)  # after every round: an interrupted study keeps it
    print(json.dumps({v: {k: m[k]["median"] for k in ("draft_share", "acceptance_length") if k in m}
                      for v, m in summary["variants"].items()}, indent=2))
    return 0

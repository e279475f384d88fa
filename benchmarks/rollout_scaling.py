"""`spectrain bench rollout_scaling RECIPE`: one engine on rank 0 against one engine per rank, side by side.

The same `parallel.dp=2` run (`spectrain fit RECIPE parallel.dp=2`, two processes under torchrun, each with one
core on a 2-core machine) runs with `rollout.engine_ranks=rank0` (one vLLM engine in rank 0's process; rank 1 waits
for its rollout) and `rollout.engine_ranks=all` (an engine per rank, each decoding half of the prompts), for `steps`
GRPO steps each, from one warm start and seed, in `rounds` interleaved rounds. Per run it keeps rollout tokens/s
(all generated tokens over the rollout's seconds, the slowest engine's) and the step-time split (rollout, policy
update, draft update, weight sync) over the timed steps (the first warms the engines up).

A third layout, `rank0_half`, is `rank0` at half the prompts: one engine alone at the batch each engine of `all`
decodes. Two engines that did not slow each other down would reach `2 x rank0_half / rank0` tokens/s of one
(`half_batch_ceiling`): below 2 where an engine's tokens/s falls with its batch.

Headline: `two_engines_over_one`, rollout tokens/s of `all` over `rank0` (median of the rounds' paired ratios,
min..max); `step_two_engines_over_one`, the same for the whole step; and `half_batch_ceiling`. The rewards of
`rank0` and `all` must agree: both serve the same per-request seeds, so they sample the same tokens up to the
numerics of the batch size (`rank0_half` trains on other prompts).

Writes `rollout_scaling.json`, `rollout_scaling.md` and `rollout_scaling.png` under `out`.

Usage: `spectrain bench rollout_scaling [RECIPE] [steps=6] [rounds=2] [out=runs/bench_rollout_scaling]
[work=runs/bench_rollout_scaling] [key=value ...]` (any other key=value is a recipe override for every run).
"""
from __future__ import annotations

import csv
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import paired_ratios, recipe_options
from benchmarks.speedup import RUN_SETTINGS, finite, ratio_text, round_order, timed, value_text
from spectrain.config import load_config
from spectrain.errors import ConfigError, SpecTrainError
from spectrain.machine import machine_label
from spectrain.plots import plot_panels

ENGINE_RANKS = {"rank0": ["rollout.engine_ranks=rank0"], "all": ["rollout.engine_ranks=all"]}
PARALLEL = ["parallel.dp=2"]
DEFAULTS = {"recipe": "tiny_cpu", "steps": 6, "rounds": 2, "out": "runs/bench_rollout_scaling",
            "work": "runs/bench_rollout_scaling"}
KEPT = ("reward", "time/step", "rollout/seconds", "rollout/tokens_per_s", "draft/seconds", "time/weight_sync",
        "spec/mean_acceptance_length", "rollout/max_running")


def logged_steps(run_dir: Path) -> list[dict[str, float]]:
    """The per-step rows of a run's CSV log, in step order (Lightning writes one row per step)."""
    rows = {}
    for path in sorted((run_dir / "logs").glob("version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("step"):
                    step = int(float(row["step"]))
                    rows.setdefault(step, {}).update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return [rows[s] for s in sorted(rows)]


def run_one(recipe: str, overrides: list[str], run_dir: Path, warmstart: Path, steps: int) -> dict:
    """`spectrain fit RECIPE parallel.dp=2 ...` in a child process (it launches the two ranks itself)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "spectrain", "fit", recipe, *overrides, *PARALLEL, *RUN_SETTINGS,
               f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}", f"trainer.warmstart_dir={warmstart}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SpecTrainError(f"bench rollout_scaling: `{' '.join(command)}` exited {done.returncode}: "
                          f"{done.stderr.strip()[-2000:]}")
    rows = logged_steps(run_dir)
    return {"per_step": {key: [row.get(key, math.nan) for row in rows] for key in KEPT}}


def run_figures(run: dict) -> dict:
    p = run["per_step"]
    rollout_s, step_s = timed(p, "rollout/seconds"), timed(p, "time/step")
    tokens = sum(t * s for t, s in zip(timed(p, "rollout/tokens_per_s"), rollout_s))
    draft = [0.0 if math.isnan(d) else d for d in timed(p, "draft/seconds")]
    sync = timed(p, "time/weight_sync")
    steps = sum(step_s)
    return {"rollout_tokens_per_s": tokens / sum(rollout_s), "step_seconds": statistics.fmean(step_s),
            "rollout_share": sum(rollout_s) / steps, "draft_share": sum(draft) / steps,
            "sync_share": sum(sync) / steps,
            "policy_share": (steps - sum(rollout_s) - sum(draft) - sum(sync)) / steps,
            "sequences_per_engine": max(finite(p["rollout/max_running"])),
            "acceptance_length": statistics.fmean(finite(timed(p, "spec/mean_acceptance_length")) or [math.nan]),
            "reward": statistics.fmean(finite(p["reward"]))}


def summarise(runs: dict[str, list[dict]]) -> dict:
    figures = {layout: [run_figures(r) for r in rs] for layout, rs in runs.items()}
    rounds = min(len(f) for f in figures.values())
    per_layout = {layout: {key: {"median": statistics.median(x), "min": min(x), "max": max(x)}
                           for key in fs[0] if (x := [f[key] for f in fs[:rounds]])}
                  for layout, fs in figures.items()}
    column = lambda layout, key: [f[key] for f in figures[layout][:rounds]]  # noqa: E731
    headline = {"two_engines_over_one": paired_ratios(column("all", "rollout_tokens_per_s"),
                                                      column("rank0", "rollout_tokens_per_s")),
                "step_two_engines_over_one": paired_ratios(column("rank0", "step_seconds"),
                                                           column("all", "step_seconds"))}
    if figures.get("rank0_half"):
        headline["half_batch_ceiling"] = paired_ratios([2 * x for x in column("rank0_half", "rollout_tokens_per_s")],
                                                       column("rank0", "rollout_tokens_per_s"))
    return {"rounds": rounds, "layouts": per_layout, "headline": headline}


def markdown(payload: dict) -> str:
    s, o, h = payload["summary"], payload["options"], payload["summary"]["headline"]
    rows = []
    for layout, m in s["layouts"].items():
        cell = lambda key, fmt=".2f", scale=1.0: value_text(m[key], fmt, scale)  # noqa: E731
        rows.append(f"| {layout} | `{' '.join(payload['layouts'][layout])}` | {cell('rollout_tokens_per_s', '.0f')} | "
                    f"{cell('sequences_per_engine', '.0f')} | {cell('step_seconds')} | "
                    f"{cell('rollout_share', '.0f', 100)}% | {cell('policy_share', '.0f', 100)}% | "
                    f"{cell('draft_share', '.0f', 100)}% | {cell('sync_share', '.0f', 100)}% | "
                    f"{cell('acceptance_length')} | {cell('reward', '.3f')} |")
    return f"""# Rollout scaling: one engine on rank 0 against one engine per rank

`{payload['command']}` on {payload['machine']}: recipe `{o['recipe']}` at `{' '.join(PARALLEL)}` (two processes),
{o['steps']} GRPO steps per run (the first not timed), {s['rounds']} interleaved rounds, one warm start and seed.

Rollout tokens/s, an engine per rank over one engine on rank 0: {ratio_text(h['two_engines_over_one'])};
the whole step: {ratio_text(h['step_two_engines_over_one'])} (above 1: faster; medians of the rounds' paired
ratios, min..max).{ceiling_text(h)}

Per layout, median over rounds (min..max): rollout tokens/s (every generated token over the rollout's seconds,
the slowest engine's); the most sequences one engine decoded at once; mean step seconds and its split.

| layout | overrides | rollout tok/s | seqs / engine | step s | rollout | policy | draft | sync | acceptance | \
reward |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

![rollout tokens/s and step seconds per step, by layout](rollout_scaling.png)
"""


def ceiling_text(headline: dict) -> str:
    if "half_batch_ceiling" not in headline:
        return ""
    c = headline["half_batch_ceiling"]
    return (f"\nWhat two engines could reach if they did not slow each other down, 2 x `rank0_half` / `rank0` "
            f"(one engine alone at half the batch): **{c['median']:.2f}x** ({c['min']:.2f}..{c['max']:.2f}).")


def mean_curve(runs: list[dict], key: str) -> tuple[list[int], list[float]]:
    values = [r["per_step"][key] for r in runs]
    steps = min(len(v) for v in values)
    return list(range(1, steps + 1)), [statistics.fmean(v[i] for v in values) for i in range(steps)]


def write_report(out: Path, runs: dict, options: dict, plan: dict[str, list[str]], command: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(runs)
    payload = {"command": command, "machine": machine_label(), "options": options, "layouts": plan,
               "summary": summary, "runs": runs}
    (out / "rollout_scaling.json").write_text(json.dumps(payload) + "\n")
    series = lambda key: {layout: mean_curve(rs, key) for layout, rs in runs.items() if rs}  # noqa: E731
    plot_panels(out / "rollout_scaling.png", f"{options['recipe']} at dp=2: engine layouts (mean over rounds)", [
        ("rollout tokens/s", series("rollout/tokens_per_s")), ("step seconds", series("time/step")),
        ("rollout seconds", series("rollout/seconds"))])
    (out / "rollout_scaling.md").write_text(markdown(payload))
    return summary


def layouts(recipe: str, overrides: list[str]) -> dict[str, list[str]]:
    """The overrides of each layout: one engine on rank 0, one per rank, and one on rank 0 at half the prompts."""
    prompts = load_config(recipe, overrides + PARALLEL).rollout.prompts_per_step
    if prompts < 2:
        raise ConfigError(f"bench rollout_scaling: rollout.prompts_per_step={prompts}: give at least 2, so that each "
                          f"of the two engines has a prompt")
    return {**ENGINE_RANKS, "rank0_half": [*ENGINE_RANKS["rank0"], f"rollout.prompts_per_step={prompts // 2}"]}


def parse(args: list[str]) -> tuple[dict, list[str], dict[str, list[str]]]:
    options, overrides = recipe_options("rollout_scaling", args, DEFAULTS,
                                        lambda _: [layout + PARALLEL for layout in ENGINE_RANKS.values()])
    return options, overrides, layouts(options["recipe"], overrides)


def main(args: list[str]) -> int:
    options, overrides, plan = parse(args)
    out, work = Path(options["out"]), Path(options["work"])
    command = " ".join(["spectrain bench rollout_scaling", *args])
    runs: dict[str, list[dict]] = {layout: [] for layout in plan}
    for round_index in range(options["rounds"]):
        for layout in round_order(list(plan), round_index):
            print(f"[bench rollout_scaling] round {round_index + 1}/{options['rounds']}: {layout}", flush=True)
            run = run_one(options["recipe"], overrides + plan[layout], work / f"round{round_index}" / layout,
                          work / "warmstart", options["steps"])
            runs[layout].append({**run, "round": round_index})
        summary = write_report(out, runs, options, plan, command)  # after every round: an interrupted study keeps it
    print(json.dumps(summary["headline"], indent=2))
    return 0

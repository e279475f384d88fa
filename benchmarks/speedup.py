"""`spectrain bench speedup RECIPE`: what speculation does to a GRPO run's speed, side by side.

The same recipe runs in every mode (none, frozen, co-trained at the recipe's `k` and at each of `ks`, and the
adaptive `concurrency` rule and `bandit`) for `steps` GRPO steps, from one warm start and the same seed, in
`rounds` interleaved rounds (each round runs every mode once, in an order rotated by the round, so a slow spell
of the machine does not land on one mode). Per run it keeps the per-step step time, rollout tokens/s,
acceptance length, draft share and reward. The first step of every run is not timed (the engine's warm-up).

Headlines (speed ratios, above 1: faster; each the median of the rounds' paired ratios, with min and max):
`e2e_cotrained_over_none` (step time of none / co-trained), `rollout_cotrained_over_none` (rollout tokens/s),
`cotrained_over_frozen` (step time of frozen / co-trained) and `adaptive_over_best_fixed_k` (the best
adaptive mode's step speed over the best fixed `k`'s, per round). Speculation is lossless, so every mode's
reward curve must match `none`'s within the sampling noise: the report gives each mode's mean train reward and
its difference to `none` with the standard error of the per-step differences.

Writes `speedup.json`, `speedup.md` and `speedup.png` under `out`.

Usage: `spectrain bench speedup [RECIPE] [steps=8] [rounds=3] [modes=...] [ks=1,2] [out=runs/bench_speedup]
[work=runs/bench_speedup] [key=value ...]` (any other key=value is a recipe override for every run).
"""
from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

from benchmarks.common import int_list, paired_ratios, recipe_options, speed_word
from spectrain.config import load_config
from spectrain.errors import ConfigError
from spectrain.machine import machine_label
from spectrain.plots import plot_panels

ADAPTIVE = ("concurrency", "bandit")
BASE_MODES = ("none", "frozen", "cotrained", *ADAPTIVE)
DEFAULTS = {"recipe": "tiny_cpu", "steps": 8, "rounds": 3, "modes": ",".join(BASE_MODES), "ks": "1,2",
            "out": "runs/bench_speedup", "work": "runs/bench_speedup"}
KEPT = ("step", "reward", "time/step", "rollout/seconds", "rollout/tokens_per_s", "draft/seconds",
        "time/weight_sync", "spec/mean_acceptance_length", "spec/k_mean", "draft/updated")
RUN_SETTINGS = ["trainer.progress_bar=false", "eval.every_n_steps=0", "trainer.log_samples_every_n_steps=0",
                "trainer.checkpoint_every_n_steps=1000000", "eval.prompts=16", "eval.samples=2"]


def fixed_k_mode(k: int) -> str:
    return f"cotrained_k{k}"


def mode_overrides(mode: str, k_max: int, verify_budget: int | None) -> list[str]:
    """The recipe overrides of one mode; the adaptive modes speculate up to the recipe's `k`."""
    if mode in ("none", "frozen", "cotrained"):
        return [f"draft.mode={mode}", "speculation.mode=fixed"]
    if mode.startswith("cotrained_k"):
        return ["draft.mode=cotrained", "speculation.mode=fixed", f"draft.num_speculative_tokens={mode[11:]}"]
    budget = [f"speculation.verify_budget={verify_budget}"] if verify_budget else []
    arms = [f"speculation.bandit.arms=[{','.join(str(k) for k in range(1, k_max + 1))}]"] if mode == "bandit" else []
    return ["draft.mode=cotrained", f"speculation.mode={mode}", *budget, *arms]


def planned_modes(options: dict, k: int) -> list[str]:
    modes = [m for m in options["modes"].split(",") if m]
    unknown = set(modes) - set(BASE_MODES)
    if unknown:
        raise ConfigError(f"bench speedup: modes={options['modes']!r}: unknown {', '.join(sorted(unknown))}; choose "
                          f"from {', '.join(BASE_MODES)}")
    if "none" not in modes:
        raise ConfigError("bench speedup: modes must include none, the baseline every ratio divides by")
    ks = [x for x in int_list("speedup", "ks", options["ks"]) if x != k] if options["ks"] else []
    if any(x < 1 or x > k for x in ks):
        raise ConfigError(f"bench speedup: ks={options['ks']!r}: each fixed k must be in 1..{k} "
                          f"(draft.num_speculative_tokens of the recipe, the adaptive modes' k_max)")
    return modes + [fixed_k_mode(x) for x in ks]


def round_order(modes: list[str], round_index: int) -> list[str]:
    shift = round_index % len(modes)
    return modes[shift:] + modes[:shift]


# ----------------------------------------------------------------------------------- running
def run_one(recipe: str, overrides: list[str], mode: str, run_dir: Path, warmstart: Path, steps: int) -> dict:
    from spectrain.train.trainer import SpecTrainer

    shutil.rmtree(run_dir, ignore_errors=True)
    config = load_config(recipe, overrides + [*RUN_SETTINGS, f"trainer.max_steps={steps}",
                                              f"trainer.run_dir={run_dir}", f"trainer.warmstart_dir={warmstart}"])
    fit = SpecTrainer(config).fit()
    per_step = {key: [row.get(key, math.nan) for row in fit.history] for key in KEPT}
    return {"mode": mode, "seconds": fit.seconds, "per_step": per_step, "speed": fit.speed}


def calibrated_budget(run_dir: Path) -> int | None:
    """The verify budget an adaptive run measured (`calibration.json`): later adaptive runs reuse it."""
    path = run_dir / "calibration.json"
    return int(json.loads(path.read_text())["verify_budget"]) if path.is_file() else None


# ---------------------------------------------------------------------------------- summaries
def finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def timed(per_step: dict, key: str) -> list[float]:
    """The steps after the first (the first rollout also warms the engine up)."""
    values = per_step[key]
    return values[1:] if len(values) > 1 else values


def run_figures(run: dict) -> dict:
    """One run's numbers over its timed steps."""
    p = run["per_step"]
    steps, rollout_s = finite(timed(p, "time/step")), timed(p, "rollout/seconds")
    tokens = sum(t * s for t, s in zip(timed(p, "rollout/tokens_per_s"), rollout_s) if math.isfinite(t * s))
    draft = [d / t for d, t in zip(timed(p, "draft/seconds"), timed(p, "time/step")) if math.isfinite(d / t)]
    acceptance = finite(timed(p, "spec/mean_acceptance_length"))
    return {"step_seconds": statistics.median(steps),
            "rollout_tokens_per_s": tokens / sum(finite(rollout_s)),
            "rollout_share": statistics.median(r / t for r, t in zip(finite(rollout_s), steps)),
            "draft_share": statistics.median(draft) if draft else 0.0,
            "acceptance_length": statistics.fmean(acceptance) if acceptance else None,
            "reward": statistics.fmean(finite(p["reward"]))}


def reward_check(runs: list[dict], base: list[dict]) -> dict:
    """Mean train reward minus none's, with the standard error of the per-step differences (all rounds)."""
    diffs = [a - b for run, ref in zip(runs, base) for a, b in zip(run["per_step"]["reward"], ref["per_step"]["reward"])
             if math.isfinite(a - b)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return {"difference": statistics.fmean(diffs), "standard_error": se, "within_noise": abs(statistics.fmean(diffs))
            <= 2 * se if math.isfinite(se) else None}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per mode: each figure's median over rounds and min..max; the headline paired ratios."""
    rounds = min(len(r) for r in runs.values())
    figures = {m: [run_figures(r) for r in rs[:rounds]] for m, rs in runs.items()}
    per_mode = {m: {key: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                    for key in fs[0] if None not in (v := [f[key] for f in fs])} for m, fs in figures.items()}
    for m in per_mode:
        if m != "none":
            per_mode[m]["reward_vs_none"] = reward_check(runs[m][:rounds], runs["none"][:rounds])
    step = {m: [f["step_seconds"] for f in fs] for m, fs in figures.items()}
    speed = lambda fast, slow: paired_ratios(step[slow], step[fast])  # noqa: E731  (>1: `fast` is faster)
    headline = {}
    if "cotrained" in figures:
        headline["e2e_cotrained_over_none"] = speed("cotrained", "none")
        headline["rollout_cotrained_over_none"] = paired_ratios(
            [f["rollout_tokens_per_s"] for f in figures["cotrained"]],
            [f["rollout_tokens_per_s"] for f in figures["none"]])
        if "frozen" in figures:
            headline["cotrained_over_frozen"] = speed("cotrained", "frozen")
    fixed = [m for m in figures if m == "cotrained" or m.startswith("cotrained_k")]
    adaptive = [m for m in figures if m in ADAPTIVE]
    if fixed and adaptive:
        best = lambda modes, i: min(step[m][i] for m in modes)  # noqa: E731  (the round's fastest)
        headline["adaptive_over_best_fixed_k"] = paired_ratios([best(fixed, i) for i in range(rounds)],
                                                               [best(adaptive, i) for i in range(rounds)])
    return {"rounds": rounds, "headline": headline, "modes": per_mode}


# ------------------------------------------------------------------------------------ reports
def ratio_text(r: dict) -> str:
    ratio, spread = speed_word(r["median"]).split(" ", 1)
    return f"**{ratio}** {spread[:-1]}; {r['min']:.2f}..{r['max']:.2f})"


def value_text(q: dict, fmt: str, scale: float = 1.0) -> str:
    return f"{q['median'] * scale:{fmt}} ({q['min'] * scale:{fmt}}..{q['max'] * scale:{fmt}})"


HEADLINE_LABELS = {
    "e2e_cotrained_over_none": "end-to-end step speed, co-trained / none",
    "rollout_cotrained_over_none": "rollout tokens/s, co-trained / none",
    "cotrained_over_frozen": "end-to-end step speed, co-trained / frozen",
    "adaptive_over_best_fixed_k": "end-to-end step speed, best adaptive / best fixed k",
}


def markdown(payload: dict) -> str:
    s, o = payload["summary"], payload["options"]
    headline = "\n".join(f"| {HEADLINE_LABELS[k]} (`{k}`) | {ratio_text(r)} |" for k, r in s["headline"].items())
    rows = []
    for mode, m in s["modes"].items():
        acceptance = value_text(m["acceptance_length"], ".2f") if "acceptance_length" in m else "—"
        check = m.get("reward_vs_none")
        reward = value_text(m["reward"], ".3f")
        if check:
            reward += f"; {check['difference']:+.3f} ± {check['standard_error']:.3f}"
        rows.append(f"| {mode} | {value_text(m['step_seconds'], '.2f')} | "
                    f"{value_text(m['rollout_tokens_per_s'], '.0f')} | {acceptance} | "
                    f"{value_text(m['rollout_share'], '.0f', 100)}% | {value_text(m['draft_share'], '.0f', 100)}% | "
                    f"{reward} |")
    return f"""# Speculation's end-to-end speedup

`{payload['command']}` on {payload['machine']}: recipe `{o['recipe']}`, {o['steps']} GRPO steps per run (the first
not timed), {s['rounds']} interleaved rounds, one warm start and seed for every run.

| headline (above 1: faster; median of the rounds' paired ratios, min..max) | |
|---|---|
{headline}

Per mode, median over rounds (min..max) of each run's median step time, rollout tokens/s (generated tokens over
rollout seconds), mean acceptance length, median rollout and draft-update shares of the step, and mean train
reward (then its difference to `none` ± the standard error of the per-step differences: speculation is lossless,
so it should be within about two standard errors).

| mode | step s | rollout tokens/s | acceptance length | rollout share | draft share | train reward; vs none |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

![per-step speed and reward by mode](speedup.png)
"""


def mean_curve(runs: list[dict], key: str) -> tuple[list[float], list[float]]:
    columns = list(zip(*(r["per_step"][key] for r in runs)))
    steps = runs[0]["per_step"]["step"]
    return steps, [statistics.fmean(v) if (v := finite(c)) else math.nan for c in columns]


def write_report(out: Path, runs: dict, options: dict, command: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(runs)
    payload = {"command": command, "machine": machine_label(), "options": options, "summary": summary,
               "headline": {k: r["median"] for k, r in summary["headline"].items()}, "runs": runs}
    (out / "speedup.json").write_text(json.dumps(payload, default=str) + "\n")
    series = lambda key: {m: mean_curve(rs, key) for m, rs in runs.items()}  # noqa: E731
    plot_panels(out / "speedup.png", f"speculation modes on {options['recipe']} (mean over rounds)", [
        ("step seconds", series("time/step")), ("rollout tokens / s", series("rollout/tokens_per_s")),
        ("mean acceptance length", {m: c for m, c in series("spec/mean_acceptance_length").items() if m != "none"}),
        ("train reward", series("reward"))])
    (out / "speedup.md").write_text(markdown(payload))
    return summary


# --------------------------------------------------------------------------------------- main
def parse(args: list[str]) -> tuple[dict, list[str]]:
    options, overrides = recipe_options("speedup", args, DEFAULTS, lambda _: [[]])
    k = load_config(options["recipe"], overrides).draft.num_speculative_tokens
    options["modes"] = ",".join(planned_modes(options, k))
    return options, overrides


def main(args: list[str]) -> int:
    options, overrides = parse(args)
    modes = options["modes"].split(",")
    k_max = load_config(options["recipe"], overrides).draft.num_speculative_tokens
    out, work = Path(options["out"]), Path(options["work"])
    command = " ".join(["spectrain bench speedup", *args])
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    budget = None
    for round_index in range(options["rounds"]):
        for mode in round_order(modes, round_index):
            print(f"[bench speedup] round {round_index + 1}/{options['rounds']}: {mode}", flush=True)
            run_dir = work / f"round{round_index}" / mode
            run = run_one(options["recipe"], overrides + mode_overrides(mode, k_max, budget), mode, run_dir,
                          work / "warmstart", options["steps"])
            runs[mode].append({**run, "round": round_index})
            budget = budget or calibrated_budget(run_dir)
        summary = write_report(out, runs, options, command)  # after every round: an interrupted study keeps it
    print(json.dumps(summary["headline"], indent=2))
    return 0

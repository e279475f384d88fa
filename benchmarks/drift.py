"""`spectrain bench drift`: does a frozen draft go stale as GRPO moves the policy, and does co-training keep up?

Long GRPO runs on the recipe (tiny_cpu: 2-digit addition), co-trained and frozen from the same warm start
and seed, in two scenarios:

- `same_task`: the warm start (policy SFT + draft warm-up) and RL on the recipe's task;
- `domain_shift`: the policy is SFT'd on the shifted task (`shift`, default 3-digit addition) and RL runs
  on it, but the draft was warmed up over that policy on the recipe's own task: it starts stale, as a draft
  trained before RL on other data does.

Every step records vLLM's acceptance length and per-position rates, the draft's loss and seconds, the
step time, the reward, and how far the policy moved (`PolicyDrift`: KL to the warm start, shift of the
draft's input features, response length). `seeds=N` repeats every run with trainer.seed 0..N-1 (the
run-to-run noise). Then a speed comparison on a deep target (`deep` overrides: a draft pass is cheap next
to a 24-layer target step, so speculation can pay on CPU): co-trained vs frozen vs no draft, rollout
tokens/s and step time with their spread over steps.

The report (drift.json, drift.md, drift*.png under `out`) is rewritten after every run, so an interrupted
study keeps what it finished; `resume=true` keeps the runs drift.json already holds and runs the rest.

Usage: `spectrain bench drift [steps=300] [speed_steps=20] [seeds=1] [scenarios=same_task,domain_shift]
[resume=false] [key=value ...]` (options: DEFAULTS; any other key=value is a recipe override for every run).
"""
from __future__ import annotations

import json
import math
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import paired_ratios, speed_word, split_options
from spectrain.config import load_config
from spectrain.errors import ConfigError
from spectrain.machine import machine_label
from spectrain.plots import plot_panels, plt

SCENARIOS = ("same_task", "domain_shift")
CURVE_MODES = ("cotrained", "frozen")
SPEED_MODES = ("cotrained", "frozen", "none")
POLICY_DRIFT = "trainer.callbacks=[{target: spectrain.callbacks.PolicyDrift}]"
KEPT = ("step", "reward", "time/step", "rollout/", "draft/loss", "draft/seconds", "spec/", "drift/")  # key prefixes
ACCEPTANCE = "spec/mean_acceptance_length"
DEFAULTS = {"recipe": "tiny_cpu", "steps": 300, "speed_steps": 20, "seeds": 1, "scenarios": ",".join(SCENARIOS),
            "shift": "toy.digits=3,rollout.response_length=32",
            "deep": "toy.num_hidden_layers=24,sft.steps=100,draft.warmup_steps=100",
            "resume": "false", "out": "runs/bench_drift", "work": "runs/bench_drift"}


@dataclass(frozen=True)
class Run:
    scenario: str  # same_task | domain_shift | deep (the speed comparison)
    mode: str  # draft.mode
    seed: int
    steps: int

    @property
    def key(self) -> str:
        return f"{self.scenario}/{self.mode}/seed{self.seed}"


def overrides_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def planned_runs(options: dict) -> list[Run]:
    """Seed by seed, each scenario's modes back to back (a partial study compares like with like), then speed."""
    scenarios = overrides_list(options["scenarios"])
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise ConfigError(f"bench drift: scenarios={options['scenarios']!r}: unknown {', '.join(sorted(unknown))}; "
                          f"choose from {', '.join(SCENARIOS)}")
    runs = [Run(s, m, seed, options["steps"]) for seed in range(options["seeds"]) for s in scenarios
            for m in CURVE_MODES]
    return runs + [Run("deep", m, 0, options["speed_steps"]) for m in SPEED_MODES if options["speed_steps"] > 0]


# ----------------------------------------------------------------------------------- running
def warmstart_dir(work: Path, run: Run) -> Path:
    """Shared by the modes of one scenario and seed; never by two scenarios (a cache is never overwritten)."""
    return work / "warmstarts" / f"{run.scenario}_seed{run.seed}"


def home_task_draft(options: dict, overrides: list[str], run: Run, work: Path) -> Path:
    """The domain-shift draft: the policy SFT'd on the shifted task, its draft warmed up on the recipe's own task.

    Both are cached: the policy in the RL runs' warm-start directory (they reuse it), the draft beside it.
    """
    import lightning as L

    from spectrain.train.trainer import SpecTrainer
    from spectrain.train.warm_start import build_and_warm_up_draft, warm_start_policy

    L.seed_everything(run.seed, verbose=False)  # as `fit` does before it builds the policy
    cache = warmstart_dir(work, run)
    common = overrides + [f"trainer.seed={run.seed}", "trainer.progress_bar=false", f"trainer.run_dir={work}"]
    shifted = SpecTrainer(load_config(options["recipe"], common + overrides_list(options["shift"])))
    shifted.build_inputs()
    policy, _ = warm_start_policy(shifted.config, shifted.build_policy(), shifted.source, shifted.tokenizer, cache,
                                  progress=False)
    home = SpecTrainer(load_config(options["recipe"], common))
    home.build_inputs()
    build_and_warm_up_draft(home.config, policy, home.source, home.tokenizer, cache / "home_task")
    return cache / "home_task" / "draft"


def scenario_overrides(options: dict, overrides: list[str], run: Run, work: Path) -> list[str]:
    if run.scenario == "domain_shift":
        return overrides_list(options["shift"]) + [
            "draft.init=path", f"draft.path={home_task_draft(options, overrides, run, work)}", "draft.warmup_steps=0"]
    return overrides_list(options["deep"]) if run.scenario == "deep" else []


def columns(history: list[dict]) -> dict[str, list[float]]:
    """The kept metrics of a run's history, one list per metric (NaN where a step has none)."""
    keys = sorted({k for row in history for k in row if k.startswith(KEPT)})
    return {k: [row.get(k, math.nan) for row in history] for k in keys}


def run_one(options: dict, overrides: list[str], run: Run, work: Path) -> dict:
    from spectrain.train.trainer import SpecTrainer

    run_dir = work / run.key
    shutil.rmtree(run_dir, ignore_errors=True)  # a run not in the report starts over
    config = load_config(options["recipe"], overrides + scenario_overrides(options, overrides, run, work) + [
        f"draft.mode={run.mode}", f"trainer.seed={run.seed}", f"trainer.max_steps={run.steps}",
        f"trainer.run_dir={run_dir}", f"trainer.warmstart_dir={warmstart_dir(work, run)}",
        "trainer.progress_bar=false", "eval.every_n_steps=0", "trainer.checkpoint_every_n_steps=1000000",
        POLICY_DRIFT])
    fit = SpecTrainer(config).fit()
    return {**asdict(run), "seconds": fit.seconds, "eval_reward_start": fit.warmstart_reward,
            "eval_reward_end": fit.final_reward, "per_step": columns(fit.history)}


# ---------------------------------------------------------------------------------- summaries
def finite(xs: list[float]) -> list[float]:
    return [x for x in xs if not math.isnan(x)]


def smooth(xs: list[float], window: int) -> list[float]:
    """Trailing mean over `window` steps (NaN skipped): the curve a reader compares, not the per-step noise."""
    out = []
    for i in range(len(xs)):
        recent = finite(xs[max(0, i - window + 1):i + 1])
        out.append(statistics.fmean(recent) if recent else math.nan)
    return out


def window_for(steps: int) -> int:
    return max(1, steps // 30)


def end_value(xs: list[float]) -> float:
    """Mean over the last tenth of the run."""
    tail = finite(xs[-max(1, len(xs) // 10):])
    return statistics.fmean(tail) if tail else math.nan


def quartiles(xs: list[float]) -> dict:
    xs = finite(xs) or [math.nan]
    q1, median, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return {"median": median, "q1": q1, "q3": q3}


def draft_share(per_step: dict) -> float:
    """Median over steps of the draft update's share of the step (0 without co-training)."""
    shares = finite([d / t for d, t in zip(per_step.get("draft/seconds", []), per_step["time/step"])])
    return statistics.median(shares) if shares else 0.0


def summarise_scenario(runs: dict, scenario: str) -> dict | None:
    """Co-trained vs frozen over the seeds that have both; None before the first pair is done."""
    seeds = [r["seed"] for r in runs.values() if r["scenario"] == scenario and r["mode"] == "cotrained"
             and f"{scenario}/frozen/seed{r['seed']}" in runs]
    if not seeds:
        return None
    pairs = {m: [runs[f"{scenario}/{m}/seed{s}"]["per_step"] for s in seeds] for m in CURVE_MODES}
    window = window_for(len(pairs["cotrained"][0]["step"]))
    acc = {m: [smooth(p[ACCEPTANCE], window) for p in pairs[m]] for m in CURVE_MODES}
    ends = {m: [end_value(p[ACCEPTANCE]) for p in pairs[m]] for m in CURVE_MODES}
    # from the second step on: the first rollout is the last one before the first online update
    min_ratio = min(min(finite([c / f for c, f in zip(co[1:], fr[1:])]), default=math.nan)
                    for co, fr in zip(acc["cotrained"], acc["frozen"]))
    drift = sorted(k for k in pairs["cotrained"][0] if k.startswith("drift/"))
    return {"seeds": seeds, "smoothing_window": window,
            "acceptance_end": {m: statistics.fmean(ends[m]) for m in CURVE_MODES},
            "cotrained_over_frozen_end": paired_ratios(ends["cotrained"], ends["frozen"]),
            "min_cotrained_over_frozen_after_first_update": min_ratio,
            "min_cotrained_acceptance": min(min(finite(co[1:]), default=math.nan) for co in acc["cotrained"]),
            "draft_share_of_step": statistics.fmean(draft_share(p) for p in pairs["cotrained"]),
            "step_seconds": {m: statistics.fmean(statistics.median(p["time/step"]) for p in pairs[m])
                             for m in CURVE_MODES},
            "drift_end": {k: {m: statistics.fmean(end_value(p[k]) for p in pairs[m]) for m in CURVE_MODES}
                          for k in drift},
            "reward_end": {m: statistics.fmean(end_value(p["reward"]) for p in pairs[m]) for m in CURVE_MODES}}


def summarise_speed(runs: dict) -> dict | None:
    """Per mode: rollout tokens/s and step seconds over the steps after the first (the engine's warm-up)."""
    done = {m: runs[f"deep/{m}/seed0"]["per_step"] for m in SPEED_MODES if f"deep/{m}/seed0" in runs}
    if not done:
        return None
    timed = lambda xs: xs[1:] if len(xs) > 1 else xs  # noqa: E731
    out = {m: {"rollout_tokens_per_s": quartiles(timed(p["rollout/tokens_per_s"])),
               "step_seconds": quartiles(timed(p["time/step"])),
               "acceptance_length": statistics.median(finite(p.get(ACCEPTANCE, [])) or [1.0]),
               "draft_share_of_step": draft_share(p)} for m, p in done.items()}
    if "none" in out:
        base = out["none"]
        out["vs_none"] = {m: {"step_seconds": s["step_seconds"]["median"] / base["step_seconds"]["median"],
                              "rollout_tokens_per_s": s["rollout_tokens_per_s"]["median"]
                              / base["rollout_tokens_per_s"]["median"]}
                          for m, s in out.items() if m != "none"}
    return out


def summarise(runs: dict) -> dict:
    return {"scenarios": {s: summary for s in SCENARIOS if (summary := summarise_scenario(runs, s))},
            "speed": summarise_speed(runs)}


# ------------------------------------------------------------------------------------ reports
def seed_mean(per_steps: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, the per-step mean over seeds) of `key`."""
    values = [p[key] for p in per_steps]
    return per_steps[0]["step"], [statistics.fmean(v) if (v := finite(list(col))) else math.nan
                                  for col in zip(*values)]


def smoothed(per_steps: list[dict], key: str) -> tuple[list[float], list[float]]:
    steps, ys = seed_mean(per_steps, key)
    return steps, smooth(ys, window_for(len(steps)))


def by_mode(runs: dict, scenario: str, modes: tuple[str, ...]) -> dict[str, list[dict]]:
    return {m: ps for m in modes if (ps := [r["per_step"] for r in runs.values()
                                            if r["scenario"] == scenario and r["mode"] == m])}


def plot_acceptance(path: Path, runs: dict, scenarios: list[str]) -> None:
    """The headline: acceptance length per step, raw points and a smoothed line, one panel per scenario."""
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6.5 * len(scenarios), 4.2), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for color, (mode, per_steps) in zip(("C0", "C1"), by_mode(runs, scenario, CURVE_MODES).items()):
            steps, acc = seed_mean(per_steps, ACCEPTANCE)
            ax.scatter(steps, acc, s=4, alpha=0.25, color=color)
            ax.plot(*smoothed(per_steps, ACCEPTANCE), color=color, label=mode)
        ax.set(title=scenario, xlabel="GRPO step", ylabel="mean acceptance length (vLLM)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("co-trained vs frozen draft over GRPO steps (line: trailing mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(out: Path, runs: dict) -> None:
    scenarios = [s for s in SCENARIOS if by_mode(runs, s, CURVE_MODES)]
    if scenarios:
        plot_acceptance(out / "drift.png", runs, scenarios)
        curves = {f"{s} {m}": ps for s in scenarios for m, ps in by_mode(runs, s, CURVE_MODES).items()}
        panel = lambda key: {label: smoothed(ps, key) for label, ps in curves.items() if key in ps[0]}  # noqa: E731
        plot_panels(out / "drift_policy.png", "how far GRPO moved the policy, and the draft's loss (trailing mean)", [
            ("KL to the warm start", panel("drift/kl_to_warmstart")),
            ("tap feature shift", panel("drift/feature_shift")),
            ("draft loss (co-trained)", panel("draft/loss")), ("train reward", panel("reward"))])
    speed = by_mode(runs, "deep", SPEED_MODES)
    if speed:
        series = lambda key: {m: seed_mean(ps, key) for m, ps in speed.items() if key in ps[0]}  # noqa: E731
        plot_panels(out / "drift_speed.png", "deep target: co-trained vs frozen vs no draft", [
            ("rollout tokens / s", series("rollout/tokens_per_s")), ("step seconds", series("time/step")),
            ("mean acceptance length", series(ACCEPTANCE))])


def ratio_text(r: dict) -> str:
    spread = f" ({r['min']:.2f}..{r['max']:.2f} over {len(r['runs'])} seeds)" if len(r["runs"]) > 1 else ""
    return f"**{r['median']:.2f}x**{spread}"


def iqr_text(q: dict, fmt: str) -> str:
    return f"{q['median']:{fmt}} ({q['q1']:{fmt}}..{q['q3']:{fmt}})"


# the header row of the report's Markdown table, too long for one source line
SCENARIO_TABLE_HEADER = ("| scenario | seeds | acceptance at end, co-trained | frozen | co-trained / frozen at end | "
                         "min co-trained / frozen after the first update | min co-trained acceptance | "
                         "draft share of step | step s co-trained / frozen (median) | KL to warm start at end | "
                         "feature shift at end | response length at end | train reward at end, co-trained / frozen |")


def markdown(payload: dict) -> str:
    o, summary = payload["options"], payload["summary"]
    rows = "\n".join(
        f"| {name} | {len(s['seeds'])} | {s['acceptance_end']['cotrained']:.2f} | "
        f"{s['acceptance_end']['frozen']:.2f} | "
        f"{ratio_text(s['cotrained_over_frozen_end'])} | {s['min_cotrained_over_frozen_after_first_update']:.2f}x | "
        f"{s['min_cotrained_acceptance']:.2f} | {100 * s['draft_share_of_step']:.1f}% | "
        f"{s['step_seconds']['cotrained']:.2f} / {s['step_seconds']['frozen']:.2f} | "
        + " | ".join(f"{s['drift_end'].get(k, {}).get('cotrained', math.nan):.3g}"
                     for k in ("drift/kl_to_warmstart", "drift/feature_shift", "drift/response_len"))
        + f" | {s['reward_end']['cotrained']:.3f} / {s['reward_end']['frozen']:.3f} |"
        for name, s in summary["scenarios"].items())
    text = f"""# Draft drift study: co-trained vs frozen over long GRPO runs

{" then ".join(f"`{c}`" for c in payload["commands"])} on {payload['machine']}.
"""
    if summary["scenarios"]:
        text += f"""
Scenarios (recipe `{o['recipe']}`, {o['steps']} GRPO steps per run, co-trained and frozen from the same warm start
and seed): **same_task**, warm start and RL on the recipe's task; **domain_shift**, the policy SFT'd and RL'd on
`{o['shift']}` while its draft was warmed up on the recipe's own task (a draft trained before RL on other data).
Acceptance at the end: mean over the last tenth of the steps; minima: over the trailing mean of each curve
(window in drift.json) from the second step on, the first rollout after an online update.

{SCENARIO_TABLE_HEADER}
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}

![acceptance length, co-trained vs frozen](drift.png)

![policy drift and draft loss](drift_policy.png)
"""
    speed = summary["speed"]
    if speed:
        speed_rows = "\n".join(
            f"| {m} | {iqr_text(s['rollout_tokens_per_s'], '.0f')} | {iqr_text(s['step_seconds'], '.2f')} | "
            f"{s['acceptance_length']:.2f} | {100 * s['draft_share_of_step']:.1f}% |"
            for m, s in speed.items() if m in SPEED_MODES)
        ratios = "; ".join(f"{m}: end to end **{speed_word(1 / r['step_seconds'])}**, rollout tokens/s "
                           f"{speed_word(r['rollout_tokens_per_s'])}" for m, r in speed.get("vs_none", {}).items())
        text += f"""
## Speed on a deep target (`{o['deep']}`, {o['speed_steps']} steps per mode)

Median (interquartile range) over the steps after the first.

| mode | rollout tokens/s | step seconds | acceptance length | draft share of step |
|---|---|---|---|---|
{speed_rows}

Against no draft (ratio of medians): {ratios or 'no `none` run yet'}.

![speed on the deep target](drift_speed.png)
"""
    return text


def write_report(out: Path, runs: dict, options: dict, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # a study resumed with other options (e.g. more seeds) names every command that produced its runs
    commands = list(dict.fromkeys([*(r["command"] for r in runs.values() if "command" in r), command]))
    payload = {"command": command, "commands": commands, "machine": machine_label(), "options": options,
               "summary": summarise(runs),
               "runs": runs}
    (out / "drift.json").write_text(json.dumps(payload) + "\n")
    write_plots(out, runs)
    (out / "drift.md").write_text(markdown(payload))


# --------------------------------------------------------------------------------------- main
def parse(args: list[str]) -> tuple[dict, list[str], bool]:
    options, overrides = split_options("drift", args, DEFAULTS)
    if options["resume"] not in ("true", "false"):
        raise ConfigError(f"bench drift: resume={options['resume']!r}: expected true or false")
    try:  # a bad recipe or override fails here, before any run
        for extra in ([], overrides_list(options["shift"]), overrides_list(options["deep"])):
            load_config(options["recipe"], overrides + extra)
    except ConfigError as exc:
        raise ConfigError(f"bench drift: {exc} (the benchmark's own options: {', '.join(DEFAULTS)})") from None
    return options, overrides, options["resume"] == "true"


def main(args: list[str]) -> int:
    options, overrides, resume = parse(args)
    plan, out, work = planned_runs(options), Path(options["out"]), Path(options["work"])
    command = " ".join(["spectrain bench drift", *args])
    report = out / "drift.json"
    runs = json.loads(report.read_text())["runs"] if resume and report.is_file() else {}
    for run in plan:
        if runs.get(run.key, {}).get("steps") == run.steps:
            print(f"[bench drift] {run.key}: in {report} already, skipped")
            continue
        print(f"[bench drift] {run.key}: {run.steps} steps", flush=True)
        runs[run.key] = {**run_one(options, overrides, run, work), "command": command}
        write_report(out, runs, options, command)
    write_report(out, runs, options, command)
    print(json.dumps(summarise(runs), indent=2, default=str))
    return 0

"""`spectrain bench drift`: co-trained vs frozen vs no draft under the same GRPO run.

All three modes share one warm start (policy SFT + draft warm-up), seeds and step count,
and run one after another in this process. Per step it records the mean acceptance
length, rollout tokens/s, step time, the draft's share of the step and the reward; it
writes `drift.json`, `drift.md` and `drift.png` under the output directory.

Usage: `spectrain bench drift [recipe=tiny_cpu] [steps=20] [out=docs/benchmarks] [key=value ...]`
(other `key=value` pairs are recipe overrides applied to all three runs).
"""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from benchmarks.common import split_options
from spectrain.config import load_config
from spectrain.errors import ConfigError
from spectrain.machine import machine_label
from spectrain.plots import plot_panels

MODES = ("cotrained", "frozen", "none")
DEFAULTS = {"recipe": "tiny_cpu", "steps": 20, "out": "docs/benchmarks", "work": "runs/bench_drift"}


def run_mode(recipe: str, mode: str, steps: int, work: Path, overrides: list[str]):
    from spectrain.train.trainer import SpecTrainer

    config = load_config(recipe, overrides + [
        f"draft.mode={mode}", f"trainer.max_steps={steps}", f"trainer.run_dir={work / mode}",
        f"trainer.warmstart_dir={work / 'warmstart'}", "trainer.progress_bar=false",
        "trainer.checkpoint_every_n_steps=1000000"])
    return SpecTrainer(config).fit()


def column(history: list[dict], key: str) -> list[float]:
    return [row.get(key, float("nan")) for row in history]


def summarise(results: dict) -> dict:
    tail = lambda xs: xs[-max(1, len(xs) // 4):]  # noqa: E731  (last quarter of the run)
    out = {}
    for mode, r in results.items():
        h = r["history"]
        acc = column(h, "spec/mean_acceptance_length")
        step_time = column(h, "time/step")
        draft_s = column(h, "draft/seconds")
        out[mode] = {
            "final_acceptance_length": statistics.mean(tail(acc)) if mode != "none" else 1.0,
            "rollout_tokens_per_s": statistics.median(column(h, "rollout/tokens_per_s")),
            "step_seconds": statistics.median(step_time),
            "draft_share_of_step": statistics.median(d / t for d, t in zip(draft_s, step_time))
            if mode == "cotrained" else 0.0,
            "final_train_reward": statistics.mean(tail(column(h, "reward"))),
            "eval_reward_start": r["warmstart_reward"], "eval_reward_end": r["final_reward"],  # sampled, held out
        }
    co, fr = out["cotrained"], out["frozen"]
    out["headline"] = {
        "acceptance_cotrained_over_frozen": co["final_acceptance_length"] / fr["final_acceptance_length"],
        "rollout_speed_cotrained_over_none": co["rollout_tokens_per_s"] / out["none"]["rollout_tokens_per_s"],
        "rollout_speed_frozen_over_none": fr["rollout_tokens_per_s"] / out["none"]["rollout_tokens_per_s"],
        "draft_share_of_step": co["draft_share_of_step"],
    }
    return out


def write_report(out_dir: Path, results: dict, summary: dict, options: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_label(), "options": options, "summary": summary,
               "per_step": {m: r["history"] for m, r in results.items()}}
    (out_dir / "drift.json").write_text(json.dumps(payload, indent=2, default=float))
    steps = {m: column(r["history"], "step") for m, r in results.items()}
    series = lambda key, modes=MODES: {m: (steps[m], column(results[m]["history"], key)) for m in modes}  # noqa: E731
    plot_panels(out_dir / "drift.png", "draft drift under GRPO: co-trained vs frozen vs no draft", [
        ("mean acceptance length (vLLM)", series("spec/mean_acceptance_length", ("cotrained", "frozen"))),
        ("rollout tokens / s", series("rollout/tokens_per_s")),
        ("step seconds", series("time/step")),
        ("train reward", series("reward")),
    ])
    h = summary["headline"]
    rows = "\n".join(
        f"| {m} | {s['final_acceptance_length']:.2f} | {s['rollout_tokens_per_s']:.0f} | {s['step_seconds']:.2f} | "
        f"{100 * s['draft_share_of_step']:.1f}% | {s['final_train_reward']:.3f} | "
        f"{s['eval_reward_start']:.3f} → {s['eval_reward_end']:.3f} |" for m, s in summary.items() if m in MODES)
    (out_dir / "drift.md").write_text(f"""# Draft drift benchmark

`spectrain bench drift {' '.join(f'{k}={v}' for k, v in options.items())}` on {machine_label()}.
Same warm start, seeds and {options['steps']} GRPO steps for each mode, run one after another.

| mode | acceptance length (last quarter) | rollout tok/s (median) | step s (median) | draft share of step | train reward (last quarter) | eval reward start → end |
|---|---|---|---|---|---|---|
{rows}

Headline (ratios measured side by side in this run):
- acceptance length, co-trained / frozen: **{h['acceptance_cotrained_over_frozen']:.2f}×**
- rollout tokens/s, co-trained / no draft: **{h['rollout_speed_cotrained_over_none']:.2f}×**; frozen / no draft: {h['rollout_speed_frozen_over_none']:.2f}×
- draft co-training share of the training step: **{100 * h['draft_share_of_step']:.1f}%**

![drift](drift.png)
""")


def main(args: list[str]) -> int:
    options, overrides = split_options("drift", args, DEFAULTS)
    try:  # a bad recipe or override fails here, before any run
        load_config(options["recipe"], overrides)
    except ConfigError as exc:
        raise ConfigError(f"bench drift: {exc} (the benchmark's own options: {', '.join(DEFAULTS)})") from None
    work = Path(options["work"])
    for mode in MODES:  # a fresh comparison each time; the shared warm start is kept
        shutil.rmtree(work / mode, ignore_errors=True)
    results = {}
    for mode in MODES:
        print(f"[bench drift] mode={mode}")
        fit = run_mode(options["recipe"], mode, options["steps"], work, overrides)
        results[mode] = {"history": fit.history, "warmstart_reward": fit.warmstart_reward,
                         "final_reward": fit.final_reward}
    summary = summarise(results)
    write_report(Path(options["out"]), results, summary, options)
    print(json.dumps(summary["headline"], indent=2))
    return 0

"""`spectrain bench draft_optimizer`: what each online-optimizer option does to a warmed-up draft.

The draft is warmed up offline (AdamW at `draft.warmup_lr`), then co-trained online during GRPO.
A fresh AdamW at the warm-up's rate makes the first online updates full-size sign steps: the
draft's loss jumps and vLLM's acceptance falls below the frozen draft's. This runs the same GRPO
steps (one shared warm start, the same seeds) once per option and records, per step, the draft
loss and the acceptance length; it writes `draft_optimizer.json|md|png` under `out`.

Usage: `spectrain bench draft_optimizer [RECIPE] [steps=20] [out=runs/bench_draft_optimizer] [key=value ...]`
(other `key=value` pairs are recipe overrides applied to every run).
"""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from benchmarks.common import recipe_options
from spectrain.config import load_config
from spectrain.machine import machine_label
from spectrain.plots import plot_panels

DEFAULTS = {"recipe": "tiny_cpu", "steps": 20, "out": "runs/bench_draft_optimizer",
            "work": "runs/bench_draft_optimizer"}
OLD = ["draft.lr_ramp_updates=0", "draft.carry_warmup_optimizer=false"]
OPTIONS = {  # label -> overrides; the last one is the default configuration
    "frozen draft": ["draft.mode=frozen"],
    "fresh AdamW, lr 3e-3 (before)": ["draft.lr=3e-3", *OLD],
    "fresh AdamW, lr 3e-4": ["draft.lr=3e-4", *OLD],
    "warm-up state carried, lr 3e-3": ["draft.lr=3e-3", "draft.lr_ramp_updates=0"],
    "lr ramp over 10 updates, lr 3e-3": ["draft.lr=3e-3", "draft.carry_warmup_optimizer=false"],
    "default: state carried + ramp + lr 3e-4": [],
}


def run_dir(work: Path, label: str) -> Path:
    return work / label.split(":")[0].replace(",", "").replace(" ", "_")


def run_option(options: dict, label: str, overrides: list[str], work: Path) -> list[dict]:
    from spectrain.train.trainer import SpecTrainer

    config = load_config(options["recipe"], overrides + OPTIONS[label] + [
        f"trainer.max_steps={options['steps']}", f"trainer.run_dir={run_dir(work, label)}",
        f"trainer.warmstart_dir={work / 'warmstart'}", "trainer.progress_bar=false", "eval.every_n_steps=0",
        "trainer.checkpoint_every_n_steps=1000000", "eval.prompts=16", "eval.samples=2"])
    return SpecTrainer(config).fit().history


def column(history: list[dict], key: str) -> list[float]:
    return [row.get(key, float("nan")) for row in history]


def summarise(histories: dict[str, list[dict]]) -> dict:
    frozen = column(histories["frozen draft"], "spec/mean_acceptance_length")
    out = {}
    for label, history in histories.items():
        acceptance, loss = column(history, "spec/mean_acceptance_length"), column(history, "draft/loss")
        out[label] = {
            "acceptance_first_5": statistics.mean(acceptance[:5]),
            "acceptance_last_quarter": statistics.mean(acceptance[-max(1, len(acceptance) // 4):]),
            "min_acceptance_over_frozen": min(a / f for a, f in zip(acceptance, frozen)),
            "draft_loss_after_first_update": loss[1] if len(loss) > 1 else float("nan"),
            "draft_loss_max": max(loss, default=float("nan")),
        }
    return out


# the header row of the report's Markdown table, too long for one source line
OPTIONS_TABLE_HEADER = ("| option | acceptance, first 5 steps | acceptance, last quarter | "
                        "min per-step acceptance / frozen | draft loss after the first update | draft loss, max |")


def write_report(out: Path, histories: dict, summary: dict, options: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_optimizer.json").write_text(json.dumps(
        {"options": options, "machine": machine_label(), "summary": summary, "histories": histories}, indent=1))
    series = lambda key: {label: (range(len(h)), column(h, key)) for label, h in histories.items()}  # noqa: E731
    plot_panels(out / "draft_optimizer.png", "online draft optimizer options (same GRPO run)",
                [("mean acceptance length (vLLM)", series("spec/mean_acceptance_length")),
                 ("draft loss (online updates)", {k: v for k, v in series("draft/loss").items()
                                                  if k != "frozen draft"})])
    rows = "\n".join(f"| {label} | {s['acceptance_first_5']:.2f} | {s['acceptance_last_quarter']:.2f} | "
                     f"{s['min_acceptance_over_frozen']:.2f} | {s['draft_loss_after_first_update']:.3f} | "
                     f"{s['draft_loss_max']:.3f} |"
                     for label, s in summary.items())
    (out / "draft_optimizer.md").write_text(f"""# Online draft optimizer options

`spectrain bench draft_optimizer {' '.join(f'{k}={v}' for k, v in options.items())}` on {machine_label()}:
{options['steps']} GRPO steps of the `{options['recipe']}` recipe per option, one shared warm start (policy SFT and
draft warm-up at `draft.warmup_lr`), the same seeds. Acceptance is vLLM's mean acceptance length per step; the
draft loss is each online update's, on its own step's rollout (none for the frozen draft).

{OPTIONS_TABLE_HEADER}
|---|---|---|---|---|---|
{rows}

![options](draft_optimizer.png)
""")


def parse(args: list[str]) -> tuple[dict, list[str]]:
    return recipe_options("draft_optimizer", args, DEFAULTS, lambda _: [[]], min_steps=1,
                          why_steps="every option trains the draft for them")


def main(args: list[str]) -> int:
    options, overrides = parse(args)
    work = Path(options["work"])
    histories = {}
    for label in OPTIONS:
        print(f"[bench draft_optimizer] {label}")
        shutil.rmtree(run_dir(work, label), ignore_errors=True)  # a fresh comparison; the warm start is kept
        histories[label] = run_option(options, label, overrides, work)
    summary = summarise(histories)
    write_report(Path(options["out"]), histories, summary, options)
    print(json.dumps(summary, indent=2))
    return 0

"""`RunHistory`: step time, a per-step record of the logged metrics, and the run's plots."""
from __future__ import annotations

import math
import time
from pathlib import Path

from typing_extensions import override

from spectrain.callbacks.held_out_eval import HeldOutEval
from spectrain.callbacks.history import HistoryCallback
from spectrain.plots import Curve, Panel, plot_grid

# the noisy per-step series: drawn raw (thin) with their EMA, one panel each when logged
SMOOTHED_PANELS = (("policy loss", "policy/loss"), ("KL to reference", "policy/kl"),
                   ("clip fraction", "policy/clip_fraction"), ("draft loss", "draft/loss"))
# the parts of a step's time that are logged on their own; the policy's training is what remains of `time/step`
STEP_TIME_PARTS = (("rollout", "rollout/seconds"), ("draft update", "draft/seconds"),
                   ("weight sync", "time/weight_sync"))
SPEED_PARTS = tuple(zip(("rollout", "draft", "sync"), (key for _, key in STEP_TIME_PARTS)))  # the summary's names


def run_speed(steps: list[dict], evaluations: list[dict]) -> dict:
    """What a run's summary says about its speed, from `RunHistory` rows and `HeldOutEval` rows (their `seconds`):
    rollout tokens/s over the whole run (generated tokens / rollout seconds), the mean of the steps' acceptance
    lengths, the median `spec/speedup_estimate` where the probe ran, and the training loop's time split in seconds
    and shares: rollout / policy (the rest of each step) / draft / sync, and outside the steps the held-out
    evaluations and the speedup probe."""
    rollout_s = sum(_finite_or_zero(r.get("rollout/seconds")) for r in steps)
    tokens = sum(_finite_or_zero(r.get("rollout/tokens_per_s")) * _finite_or_zero(r.get("rollout/seconds"))
                 for r in steps)
    parts = {label: sum(_finite_or_zero(r.get(key)) for r in steps) for label, key in SPEED_PARTS}
    policy = max(0.0, sum(_finite_or_zero(r.get("time/step")) for r in steps) - sum(parts.values()))
    split = {"rollout": parts.pop("rollout"), "policy": policy, **parts}
    split["eval"] = sum(_finite_or_zero(r.get("seconds")) for r in evaluations)
    split["speedup_probe"] = sum(_finite_or_zero(r.get("time/speedup_probe")) for r in steps)
    total = sum(split.values())
    acceptance = [r["spec/mean_acceptance_length"] for r in steps
                  if math.isfinite(r.get("spec/mean_acceptance_length", math.nan))]
    estimates = sorted(r["spec/speedup_estimate"] for r in steps if math.isfinite(r.get("spec/speedup_estimate",
                                                                                             math.nan)))
    return {"steps": len(steps), "generated_tokens": round(tokens),
            "rollout_tokens_per_s": round(tokens / rollout_s, 1) if rollout_s else None,
            "mean_acceptance_length": round(sum(acceptance) / len(acceptance), 3) if acceptance else None,
            "speedup_estimate": round(estimates[len(estimates) // 2], 3) if estimates else None,
            "seconds": {k: round(v, 2) for k, v in split.items()},
            "share": {k: round(v / total, 3) if total else None for k, v in split.items()}}


def speed_line(speed: dict) -> str:
    """The summary's speed in one line, for the end of `spectrain fit`."""
    parts = [f"rollout {speed['rollout_tokens_per_s']} tok/s"]
    if speed["mean_acceptance_length"] is not None:
        parts.append(f"acceptance length {speed['mean_acceptance_length']}")
    if speed["speedup_estimate"] is not None:
        parts.append(f"speculation speedup {speed['speedup_estimate']}x (probe)")
    shares = ", ".join(f"{k} {v:.0%}" for k, v in speed["share"].items() if v)
    return f"[spectrain] speed: {'; '.join(parts)}; time: {shares}"


def _finite_or_zero(value) -> float:
    return value if value is not None and math.isfinite(value) else 0.0


def finite(xs: list, ys: list) -> tuple[list, list]:
    """The points whose value is a number: the steps a callback skips log NaN, which would break the line."""
    kept = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    return [x for x, _ in kept], [y for _, y in kept]


class RunHistory(HistoryCallback):
    """Place it last: its step time then covers rollout, policy, draft and weight sync.

    Keeps one dict of scalar metrics per step (checkpointed, so a resumed run plots its whole history) and at
    the end draws `training.png`, a grid of per-step panels over one step axis: reward (train rollouts, and
    with `HeldOutEval` the held-out greedy and sampled points), policy loss, KL to the reference, clip
    fraction, draft loss, mean acceptance length (y from 1 to its ceiling k+1), rollout tokens/s, and the
    step time split into rollout / policy training / draft update / weight sync (and the held-out evaluation
    after the step) with the step's total as a line. `run_speed` sums the same parts for the run's summary.
    The noisy series are drawn raw (thin) with an EMA; a panel whose metrics were never logged is left out.
    `num_speculative_tokens` (k) sets the acceptance ceiling; None: the module's `config.draft`'s at the end.
    """

    # its step time covers them (Lightning runs its own ModelCheckpoints after every other callback)
    runs_after = ("BestCheckpoints", "HeldOutEval", "PeriodicExport")

    def __init__(self, plot_path: str | None = None, num_speculative_tokens: int | None = None) -> None:
        super().__init__()
        self.plot_path = plot_path
        self.num_speculative_tokens = num_speculative_tokens
        self._started = 0.0

    @property
    @override
    def state_key(self) -> str:
        # the trainer's instance (default plot path) keeps the class name, under which earlier checkpoints hold its
        # history; one more with its own plot path (trainer.callbacks) checkpoints beside it instead of colliding
        return self._generate_state_key(plot_path=self.plot_path) if self.plot_path else super().state_key

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step_time = time.perf_counter() - self._started
        pl_module.log("time/step", step_time, prog_bar=True, on_step=True, batch_size=1)
        row = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        row.update({"step": trainer.global_step, "time/step": step_time})
        self.history.append(row)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if self.history and trainer.is_global_zero:
            held_out = next((c for c in trainer.callbacks if isinstance(c, HeldOutEval)), None)
            self.plot(Path(self.plot_path or Path(trainer.default_root_dir) / "training.png"), held_out,
                      self._speculative_tokens(pl_module))

    def _speculative_tokens(self, pl_module) -> int | None:
        """k as given, else the run's config (None without one: the acceptance panel then has no ceiling)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        draft = getattr(getattr(pl_module, "config", None), "draft", None)
        return getattr(draft, "num_speculative_tokens", None)

    def column(self, key: str) -> tuple[list[int], list[float]]:
        rows = [r for r in self.history if key in r]
        return [r["step"] for r in rows], [r[key] for r in rows]

    def finite_column(self, key: str) -> tuple[list[int], list[float]]:
        return finite(*self.column(key))

    def plot(self, path: Path, held_out: HeldOutEval | None = None,
             num_speculative_tokens: int | None = None) -> Path:
        return plot_grid(path, "spectrain run", self.panels(held_out, num_speculative_tokens), columns=4)

    def panels(self, held_out: HeldOutEval | None = None, num_speculative_tokens: int | None = None) -> list[Panel]:
        """The figure as data (the tests read it): the panels with something to draw, in reading order."""
        candidates = [self.reward_panel(held_out)]
        candidates += [self.smoothed_panel(title, key) for title, key in SMOOTHED_PANELS]
        candidates += [self.acceptance_panel(num_speculative_tokens), self.tokens_per_second_panel(),
                       self.step_time_panel(held_out)]
        return [p for p in candidates if p is not None and any(c.xs for c in p.curves)]

    def reward_panel(self, held_out: HeldOutEval | None) -> Panel:
        series = [Curve("train rollouts", *self.finite_column("reward"), style="smoothed")]
        if held_out is not None:
            series += [Curve("held-out, greedy", *finite(*held_out.column("greedy_reward")), style="markers"),
                       Curve("held-out, sampled", *finite(*held_out.column("sampled_reward")), style="markers")]
        return Panel("reward", [s for s in series if s.xs], ylabel="mean reward")

    def smoothed_panel(self, title: str, key: str, ylabel: str = "") -> Panel:
        return Panel(title, [Curve("per step", *self.finite_column(key), style="smoothed")], ylabel=ylabel)

    def acceptance_panel(self, k: int | None) -> Panel:
        """From 1 (no draft token accepted) to the ceiling k+1 plus a margin: a fixed scale, so noise stays small."""
        panel = self.smoothed_panel("mean acceptance length", "spec/mean_acceptance_length", ylabel="tokens / step")
        if k is None:
            return Panel(panel.title, panel.curves, panel.ylabel, ymin=1.0)
        ceiling = float(k + 1)
        top = max([ceiling, *panel.curves[0].ys])
        return Panel(panel.title, panel.curves, panel.ylabel, ceiling=ceiling, ymin=1.0, ymax=top + 0.05 * k)

    def tokens_per_second_panel(self) -> Panel:
        # `rollout/tokens_per_s` is the module's generated tokens / rollout seconds of each step
        return self.smoothed_panel("rollout tokens/s", "rollout/tokens_per_s", ylabel="generated tokens / s")

    def step_time_panel(self, held_out: HeldOutEval | None = None) -> Panel:
        """Stacked bars of the step's logged parts and the rest (the policy's training and anything unlogged),
        with the total `time/step` as a line; a held-out evaluation after a step (outside its `time/step`) is
        stacked on that step's bar. A part NaN or absent on a step counts 0 there."""
        steps, totals = self.finite_column("time/step")
        rows = {r["step"]: r for r in self.history}
        parts = [(label, key) for label, key in STEP_TIME_PARTS if self.finite_column(key)[0]]
        seconds = {label: [self._seconds(rows[s], key) for s in steps] for label, key in parts}
        rest = [max(0.0, total - sum(part[i] for part in seconds.values())) for i, total in enumerate(totals)]
        stacked = [("rollout", seconds.pop("rollout"))] if "rollout" in seconds else []
        stacked += [("policy training", rest), *seconds.items()]
        evaluated = {r["step"]: r["seconds"] for r in (held_out.history if held_out else []) if "seconds" in r}
        if any(s in evaluated for s in steps):
            stacked.append(("held-out eval", [evaluated.get(s, 0.0) for s in steps]))
        series = [Curve(label, steps, ys, style="stacked") for label, ys in stacked]
        return Panel("step time split", [*series, Curve("step total", steps, totals)], ylabel="seconds")

    @staticmethod
    def _seconds(row: dict, key: str) -> float:
        return _finite_or_zero(row.get(key))

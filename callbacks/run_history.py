"""`RunHistory`: step time, a per-step record of the logged metrics, and the run's plots."""
from __future__ import annotations

import time
from pathlib import Path

from typing_extensions import override

from spectrain.callbacks.history import HistoryCallback
from spectrain.callbacks.held_out_eval import HeldOutEval
from spectrain.plots import plot_panels


class RunHistory(HistoryCallback):
    """Place it last: its step time then covers rollout, policy, draft and weight sync.

    Keeps one dict of scalar metrics per step (checkpointed, so a resumed run plots its
    whole history) and draws reward (train and, with `HeldOutEval`, held-out), acceptance
    length and step time per step at the end.
    """

    def __init__(self, plot_path: str | None = None) -> None:
        super().__init__()
        self.plot_path = plot_path
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
            self.plot(Path(self.plot_path or Path(trainer.default_root_dir) / "training.png"), held_out)

    def column(self, key: str) -> tuple[list[int], list[float]]:
        rows = [r for r in self.history if key in r]
        return [r["step"] for r in rows], [r[key] for r in rows]

    def plot(self, path: Path, held_out: HeldOutEval | None = None) -> Path:
        rewards = {"train rollouts": self.column("reward")}
        if held_out is not None:
            rewards.update({"held-out, sampled": held_out.column("sampled_reward"),
                            "held-out, greedy": held_out.column("greedy_reward")})
        panels = [("mean reward", rewards)]
        if self.column("spec/mean_acceptance_length")[0]:
            panels.append(("mean acceptance length", {"vLLM": self.column("spec/mean_acceptance_length")}))
        panels.append(("seconds", {"step": self.column("time/step"), "rollout": self.column("rollout/seconds")}))
        return plot_panels(path, "spectrain run", panels)


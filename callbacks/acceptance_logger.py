"""`AcceptanceLengthLogger`: per-step speculative-decoding metrics from vLLM's counters."""
from __future__ import annotations

import math
from pathlib import Path

from typing_extensions import override

from spectrain.callbacks.history import HistoryCallback
from spectrain.plots import plot_panels


class AcceptanceLengthLogger(HistoryCallback):
    """Logs the rollout's deltas of vLLM's spec-decode counters and plots them per step.

    Metrics: `spec/mean_acceptance_length` (1 + accepted/drafts: tokens per target forward),
    `spec/acceptance_rate` (accepted/drafted tokens), `spec/pos_{k}_rate` (fraction of drafts
    whose k-th token was accepted); with several engines also `spec/engine_acceptance_min` / `_max` (each
    engine's own acceptance length), so a lagging engine shows. The plot lands in `plot_path` (default: the run dir).
    """

    def __init__(self, plot_path: str | None = None) -> None:
        super().__init__()
        self.plot_path = plot_path

    @property
    @override
    def state_key(self) -> str:
        # the trainer's instance (default plot path) keeps the class name, under which earlier checkpoints hold its
        # history; one more with its own plot path (trainer.callbacks) checkpoints beside it instead of colliding
        return self._generate_state_key(plot_path=self.plot_path) if self.plot_path else super().state_key

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        spec = outputs["step"].rollout.spec
        if spec.num_drafts == 0:  # nothing drafted (k=0): NaN, or Lightning repeats the last step's values
            if self.history:
                pl_module.log_dict({f"spec/{k}": math.nan for k in self.history[-1] if k != "step"},
                                   on_step=True, batch_size=1)
            return
        row = {"step": trainer.global_step, "mean_acceptance_length": spec.mean_acceptance_length,
               "acceptance_rate": spec.acceptance_rate}
        row.update({f"pos_{k}_rate": r for k, r in enumerate(spec.per_position_rates)})
        per_engine = outputs["step"].rollout.per_engine_acceptance
        if len(per_engine) > 1:
            row.update(engine_acceptance_min=min(per_engine), engine_acceptance_max=max(per_engine))
        self.history.append(row)
        metrics = {f"spec/{k}": v for k, v in row.items() if k != "step"}
        pl_module.log_dict(metrics, on_step=True, batch_size=1)
        pl_module.log("accept_len", spec.mean_acceptance_length, prog_bar=True, on_step=True, batch_size=1,
                      logger=False)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if self.history and pl_module.plan.is_rollout_rank:
            path = Path(self.plot_path or Path(trainer.default_root_dir) / "acceptance_length.png")
            self.plot(path)

    def plot(self, path: Path) -> Path:
        steps = [r["step"] for r in self.history]
        positions = sorted(k for k in self.history[-1] if k.startswith("pos_"))
        return plot_panels(path, "speculative decoding per step", [
            ("mean acceptance length",
             {"acceptance length": (steps, [r["mean_acceptance_length"] for r in self.history])}),
            ("acceptance rate by draft position", {
                k.removesuffix("_rate"): (steps, [r.get(k, 0.0) for r in self.history]) for k in positions}),
        ])


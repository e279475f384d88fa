"""The training progress display: a bar on a terminal, plain lines in a log (`spectrain.console.interactive`)."""
from __future__ import annotations

from lightning.pytorch.callbacks import Callback, RichProgressBar
from typing_extensions import override

from spectrain.console import step_line


class SpecProgressBar(RichProgressBar):
    """Lightning's bar, named for what it counts: GRPO steps of `trainer.max_steps` (not `Epoch 0/-2`, the epoch
    of an endless prompt stream), without the logger's `v_num`."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return "GRPO steps"

    @override
    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class PlainProgress(Callback):
    """One line per `every_n_steps` steps (and the last), flushed: what a log file or a CI job shows."""

    runs_after = ("RunHistory",)  # the line shows the step's time

    def __init__(self, every_n_steps: int = 1) -> None:
        self.every_n_steps = every_n_steps

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step % self.every_n_steps == 0 or step == trainer.max_steps):
            print(step_line(step, trainer.max_steps, trainer.callback_metrics), flush=True)

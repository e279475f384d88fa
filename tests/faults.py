"""Faults the end-to-end tests inject into real runs (importable as `tests.faults` from a recipe)."""
from __future__ import annotations

import os
import signal

from lightning.pytorch.callbacks import Callback

KILL_ENV = "SPECTRAIN_TEST_SIGNAL_AT"  # "STEP:SIGNAL", e.g. "3:SIGKILL"; unset: the callback does nothing


class SignalAtStep(Callback):
    """Sends a signal to its own process when step STEP starts, as a scheduler or a crash would.

    Driven by an environment variable, so that the run's config (which a resume compares) is
    the same in the interrupted run, its resume and the uninterrupted reference.
    """

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step, _, name = os.environ.get(KILL_ENV, "").partition(":")
        if step and trainer.global_step == int(step):
            os.kill(os.getpid(), getattr(signal, name))

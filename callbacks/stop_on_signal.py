"""`StopOnSignal`: SIGTERM or SIGINT finishes the step, saves a checkpoint and stops the run."""
from __future__ import annotations

import signal
import sys
import threading

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from spectrain.errors import SpecTrainError

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(SpecTrainError):
    """The run stopped on a signal after saving a checkpoint; `exit_code` is the shell's 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopOnSignal(Callback):
    """What a cluster scheduler (SIGTERM) or Ctrl-C (SIGINT) should get: no lost work.

    The signal is only noted; at the end of the step in flight every rank agrees on it (a max
    over ranks), the checkpoint is written to `ckpt_path` and the loop stops after logging the
    step; `SpecTrainer.fit` then raises `interruption()`, and the same command resumes the run.
    The same signal a second time aborts at once (another one, such as the SIGTERM torchrun sends
    after a Ctrl-C, does not). Place it after every callback whose state the checkpoint must
    hold. Handlers are installed only in the main thread and restored at the end.
    """

    def __init__(self, ckpt_path: str) -> None:
        self.ckpt_path = ckpt_path
        self.received: int = 0  # the signal noted on this rank
        self.stopped_by: int = 0  # the signal the run stopped on (agreed by every rank)
        self._previous: dict[int, object] = {}
        self._speaks = True  # rank 0 only: every rank of a torchrun job gets the signal

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._speaks = trainer.is_global_zero
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._note) for sig in _SIGNALS}

    def _note(self, signum: int, frame) -> None:
        if self.received == signum:  # the same signal twice: a person insisting
            self._restore()
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborting without a checkpoint")
        if self.received:
            return
        self.received = signum
        if self._speaks:
            print(f"\n[spectrain] {signal.Signals(signum).name} received: finishing the step, then saving a checkpoint "
                  f"(send it again to abort at once)", file=sys.stderr, flush=True)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stopped_by = int(trainer.strategy.reduce(torch.tensor(float(self.received)), reduce_op="max").item())
        if self.stopped_by:
            trainer.save_checkpoint(self.ckpt_path)
            trainer.should_stop = True  # the loop still logs this step's metrics, then ends

    def interruption(self, steps: int) -> RunInterrupted:
        """The error `SpecTrainer.fit` raises after the loop ended on a signal."""
        name = signal.Signals(self.stopped_by).name
        return RunInterrupted(f"stopped by {name} after {steps} steps; the checkpoint is {self.ckpt_path}. "
                              f"Run the same command again to resume from it.", self.stopped_by)

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

"""SIGTERM or SIGINT: `StopOnSignal` finishes the step, saves a checkpoint and stops the run; outside the
training loop (`InterruptOnSignal`: warm start, engine start, evaluations) the run stops at once."""
from __future__ import annotations

import signal
import sys
import threading

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from spectrain.errors import RunInterrupted

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal(Callback):
    """What a cluster scheduler (SIGTERM) or Ctrl-C (SIGINT) should get: no lost work.

    The signal is only noted; at the end of the step in flight every rank agrees on it (a max
    over ranks), the checkpoint is written to `ckpt_path` and the loop stops after logging the
    step; `SpecTrainer.fit` then raises `interruption()`, and the same command resumes the run.
    The same signal a second time aborts at once (another one, such as the SIGTERM torchrun sends
    after a Ctrl-C, does not). Place it after every callback whose state the checkpoint must
    hold. Handlers are installed only in the main thread and restored at the end.
    """

    runs_after = ("RunHistory",)  # its checkpoint holds every state of the step (ModelCheckpoints run last anyway)

    def __init__(self, ckpt_path: str) -> None:
        self.ckpt_path = ckpt_path
        self.received: int = 0  # the signal noted on this rank
        self.stopped_by: int = 0  # the signal the run stopped on (agreed by every rank)
        self._previous: dict[int, signal._HANDLER] = {}
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


class InterruptOnSignal:
    """Outside the training loop there is no step to finish: SIGTERM or SIGINT stops at once with the
    same one-line `RunInterrupted` (and exit code) as in the loop, naming what was running.

    `SpecTrainer.fit` installs it for the whole run and sets `phase` as it goes; `StopOnSignal`
    takes over inside the loop and gives it back after. An interrupted warm start leaves no cache
    (a cache appears in one rename when complete), so the same command always continues the run.
    """

    def __init__(self) -> None:
        self.phase = "the start-up checks: nothing was written"
        self._previous: dict[int, signal._HANDLER] = {}

    def __enter__(self) -> "InterruptOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._interrupt) for sig in _SIGNALS}
        return self

    def __exit__(self, exc_type=None, exc=None, tb=None) -> None:
        self._restore()
        if isinstance(exc, _Interrupt):
            raise exc.error from None

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _interrupt(self, signum: int, frame) -> None:
        self._restore()  # a second signal gets the default behaviour
        raise _Interrupt(RunInterrupted(f"stopped by {signal.Signals(signum).name} during {self.phase}. Run the same "
                                        f"command again to continue.", signum))


class _Interrupt(BaseException):
    """Carries the `RunInterrupted` out of the frame the signal landed in. A BaseException, like KeyboardInterrupt,
    so that no `except Exception` on the way (vLLM's start-up has many) swallows the signal; the `with` block
    turns it back into the `RunInterrupted` the CLI reports."""

    def __init__(self, error: RunInterrupted) -> None:
        super().__init__(str(error))
        self.error = error

"""The errors a user can hit: each message says what is wrong and how to fix it.

`spectrain` (the CLI) prints any `SpecTrainError` as one line and exits with code 2; the
traceback is shown only with `--debug`. Anything else is a bug and keeps its traceback.
An input that is accepted but would not do what it looks like it does is an `InputWarning`,
given at start-up (config validation, `SpecTrainer.check_inputs`), once per run.
"""
from __future__ import annotations

import warnings


class SpecTrainError(RuntimeError):
    """Base of every error whose message is meant for the user, not for a debugger."""


class ConfigError(SpecTrainError, ValueError):
    """A recipe or override is wrong; the message names the key and how to fix it."""


class RunDirError(SpecTrainError):
    """The run directory (or warm-start cache) cannot be used without losing somebody's data."""


class RolloutEngineError(SpecTrainError):
    """The engine could not start or a sync left it in a bad state; the message says how to fix it."""


class SyncMismatchError(SpecTrainError):
    """The engine does not serve the weights the trainer sent it (a policy or draft sync failed)."""


class SpeculationDeadError(SpecTrainError):
    """The engine drafted but (almost) never accepted after a draft sync: the drafter was lost."""


class NonFiniteError(SpecTrainError):
    """A loss or gradient norm is NaN/inf: the run stopped before the optimizer step, so no NaN reached the weights."""


class InputWarning(UserWarning):
    """An accepted input that will not do what it looks like it does; the message names the key and the fix."""


def warn_input(message: str) -> None:
    """Warn once, at start-up, about an input that is accepted but probably not what its user meant."""
    warnings.warn(f"[spectrain] {message}", InputWarning, stacklevel=3)


class RunInterrupted(SpecTrainError):
    """The run stopped on a signal (after saving a checkpoint, in the training loop); `exit_code` is the
    shell's 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum

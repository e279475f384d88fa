"""The errors a user can hit: each message says what is wrong and how to fix it.

`spectrain` (the CLI) prints any `SpecTrainError` as one line and exits with code 2; the
traceback is shown only with `--debug`. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations


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

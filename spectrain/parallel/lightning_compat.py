"""Every private Lightning internal `SpecParallelStrategy` touches, checked against the release it was verified on.

The strategy replaces DDP's process launching (`Strategy._configure_launcher`: torchrun
starts the ranks) and reuses Lightning's own helpers for logged-value reduction and for
moving optimizer state. Lightning may rename such internals between releases, so each is
looked up here; a missing one raises a `LightningVersionError` naming the installed
Lightning, the verified one and the fix, instead of an AttributeError (or, for a hook, an
override Lightning silently stops calling) in the middle of a run.
"""
from __future__ import annotations

import lightning

from spectrain.errors import SpecTrainError
from spectrain.internals import Internals

VERIFIED_VERSION = "2.6.6"  # the Lightning release every function here was written and tested against


class LightningVersionError(SpecTrainError):
    """The installed Lightning lacks an internal spectrain.parallel relies on."""


_LIGHTNING = Internals("Lightning", "lightning", lightning.__version__, VERIFIED_VERSION,
                       "spectrain/parallel/lightning_compat.py", LightningVersionError)
internal = _LIGHTNING.internal


def check_private_hooks(base: type, *names: str) -> None:
    """Fail unless `base` still defines the private hooks a subclass overrides (else Lightning would skip them)."""
    for name in names:
        if not callable(getattr(base, name, None)):
            raise _LIGHTNING.incompatible(f"{base.__name__}.{name}")


def sync_ddp_if_available(tensor, group, reduce_op):
    """Lightning's in-place reduction of a logged tensor over the process group (a no-op in one process)."""
    return internal("lightning.fabric.utilities.distributed", "_sync_ddp_if_available")(
        tensor, group, reduce_op=reduce_op)


def optimizers_to_device(optimizers, device) -> None:
    """Move every optimizer's state to `device`, as Lightning's own strategies do after setup."""
    internal("lightning.fabric.utilities.optimizer", "_optimizers_to_device")(optimizers, device)

"""Looking up a library's private internals, failing with the installed and the verified release.

One seam per library keeps every private attribute spectrain uses (`rollout/vllm/compat.py`
for vLLM, `parallel/torch_compat.py` for torch, `parallel/lightning_compat.py` for Lightning);
each looks them up through an `Internals`, so a renamed one raises a `SpecTrainError` that
says which release the code was verified on and how to fix it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from spectrain.errors import SpecTrainError


@dataclass(frozen=True)
class Internals:
    library: str  # as users know it: "torch", "Lightning"
    package: str  # as pip installs it
    installed: str
    verified: str  # the release every lookup was written and tested against
    seam: str  # the file to port to another release
    error: type[SpecTrainError]

    def incompatible(self, what: str) -> SpecTrainError:
        return self.error(f"{self.library} {self.installed} has no {what}, which spectrain uses (verified on "
                          f"{self.library} {self.verified}): install the verified release (pip install "
                          f"'{self.package}=={self.verified}', or `make setup`), or port {self.seam} to the "
                          f"installed one")

    def internal(self, module: str, name: str):
        """`module.name`, or the error that says which release was verified."""
        try:
            return getattr(importlib.import_module(module), name)
        except (ModuleNotFoundError, AttributeError) as exc:
            raise self.incompatible(f"{module}.{name}") from exc

    def attribute(self, obj, name: str, owner: str):
        """`obj.name` on a live object (of class `owner`), or the error that says which release was verified."""
        try:
            return getattr(obj, name)
        except AttributeError as exc:
            raise self.incompatible(f"{owner}.{name}") from exc

"""Which machine a measurement comes from (absolute timings are only valid with it), and which device a run uses."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from spectrain.errors import ConfigError


def machine_label() -> str:
    """CPU model, core count, torch threads, torch version, and whether Intel OpenMP is preloaded."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    cpu = names[0] if names else platform.processor() or platform.machine()
    runtime = ", Intel OpenMP preloaded" if "libiomp5" in os.environ.get("LD_PRELOAD", "") else ""
    return f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, torch {torch.__version__}{runtime}"


def resolve_device(accelerator: str) -> torch.device:
    """The trainer's device for `trainer.accelerator` (Lightning's `auto` takes CUDA when there is one); `cuda` on a
    machine without it is refused here, at start-up, not by torch's assertion at the first tensor."""
    if accelerator == "cuda" and not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "torch finds no CUDA device on this machine")
        raise ConfigError(f"trainer.accelerator: is cuda, but {why}; use trainer.accelerator=auto (CUDA when there "
                          f"is one) or trainer.accelerator=cpu")
    if accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

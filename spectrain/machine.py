"""Which machine a measurement comes from: absolute timings are only valid with it."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine_label() -> str:
    """CPU model, core count, torch threads and torch version."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    cpu = names[0] if names else platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, torch {torch.__version__}"

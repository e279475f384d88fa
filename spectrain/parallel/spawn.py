"""Run a function in real worker processes with a gloo process group (tests and benchmarks).

    from spectrain.parallel.spawn import run_distributed

    def _worker(rank, world_size, x):        # module level, so spawn can pickle it
        return x * rank                       # anything torch.save can write

    results = run_distributed(_worker, 2, torch.ones(3), timeout=120)  # [rank0, rank1]

Each worker: ``torch.set_num_threads(1)``, a gloo WORLD group on 127.0.0.1 (free port),
then ``fn(rank, world_size, *args)``. Results come back through torch.save bytes (no
shared-memory handles that die with the worker). A worker's exception is re-raised in the
caller with its traceback; a hang raises TimeoutError after ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import io
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _entry(rank: int, world_size: int, port: int, timeout: float, fn, args, results) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        results.put((rank, True, _dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:  # after reporting, so the root cause is queued before peers see the teardown
        if dist.is_initialized():
            dist.destroy_process_group()


def _drain_failures(results, first: tuple[int, str], grace: float = 3.0) -> str:
    """All failure reports arriving within ``grace`` seconds, the first one first."""
    failures = [first]
    deadline = time.monotonic() + grace
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            rank, ok, payload = results.get(timeout=remaining)
        except queue.Empty:
            break
        if not ok:
            failures.append((rank, payload))
    return "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in failures)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo workers.

    Returns the per-rank return values in rank order. ``fn`` and ``args`` must be picklable
    (define ``fn`` at module level).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(rank, world_size, port, timeout, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, ok, payload = results.get(timeout=max(min(remaining, 1.0), 0.01))
            except queue.Empty:
                if remaining <= 0:
                    raise TimeoutError(
                        f"distributed test timed out after {timeout}s; ranks without a result: "
                        f"{sorted(set(range(world_size)) - set(outputs))}"
                    ) from None
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise RuntimeError(f"worker(s) {dead} died without reporting (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})")
                continue
            if not ok:
                report = _drain_failures(results, (rank, payload))
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{report}")
            outputs[rank] = _loads(payload)
    except BaseException:
        for p in procs:  # peers of a failed rank would block until the gloo timeout
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [outputs[r] for r in range(world_size)]

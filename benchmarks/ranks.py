"""Run a benchmark body on `world` spawned local processes and gather one result per rank."""
from __future__ import annotations

import queue
import socket
import time
import traceback
from collections.abc import Callable


def _rank_entry(fn: Callable, rank: int, port: int, args: tuple, results) -> None:
    try:
        results.put((rank, True, fn(rank, port, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(fn: Callable, world: int, args: tuple, timeout_s: float, label: str) -> list:
    """`fn(rank, port, *args)` on `world` spawned processes (`fn` at module level, so spawn can
    pickle it; `port` is a free local port for the process group); the results by rank.

    A rank that raises, or no result within `timeout_s`, fails the whole run with the rank's traceback.
    """
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, port, args, results), daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        out, deadline = {}, time.monotonic() + timeout_s
        while len(out) < world:
            try:
                rank, ok, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{label}: no result after {timeout_s:.0f}s") from None
            if not ok:
                raise RuntimeError(f"{label}: rank {rank} failed:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]

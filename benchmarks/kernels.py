"""`spectrain bench kernels`: the GPU kernels against the torch paths, time and peak memory by token count.

Two measurements, each forward + backward on the same random inputs:
- TTT attention of the last pass (trunk + `passes - 1` branch keys per row) through the plain-torch blockwise
  ops (`torch`), torch's own varlen flash kernel for the trunk with the closed-form branch (`varlen`, CUDA only)
  and the fused Triton kernel (`triton`);
- the draft loss (lm_head over the draft vocabulary + soft cross-entropy against the teacher) dense (`torch`),
  chunked in torch (`chunked`) and in Triton (`triton`).
Headline ratios are taken side by side in one run: Triton time over torch time for the attention, fused peak
memory over unfused peak memory for the loss. Peak memory is CUDA's allocator peak above the inputs (not
measured on CPU). Writes `kernels.json|md|png` under `out` (default `runs/bench_kernels`; `out=docs/benchmarks/gpu`
writes where `scripts/gpu_check.sh` puts GPU results; none are committed yet).

The "torch" attention path is what `policy.attention_backend=torch` runs: the blockwise torch trunk and the
closed-form branch (on CUDA their log-sum-exp merge is the Triton merge kernel, as in a run).

Usage: `spectrain bench kernels [tokens=4096,...] [key=value ...]`. Without a GPU it is a correctness dry run
(what `scripts/gpu_check.sh --cpu-dry-run` calls): tiny sizes, the Triton kernels under the interpreter, results
under `runs/bench_kernels_cpu` (timings there mean nothing; it checks that every path runs).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import int_list, parse_options
from spectrain.errors import ConfigError
from spectrain.machine import machine_label
from spectrain.plots import plot_panels

DEFAULTS = {"tokens": "4096,8192,16384,32768,65536", "doc_tokens": 2048, "heads": 32, "kv_heads": 8,
            "head_dim": 128, "passes": 3, "hidden": 4096, "vocab": 32000, "chunk": 1024, "reps": 5,
            "dtype": "bfloat16", "out": "runs/bench_kernels"}
CPU_DEFAULTS = {**DEFAULTS, "tokens": "64,128", "doc_tokens": 40, "heads": 4, "kv_heads": 2, "head_dim": 16,
                "hidden": 32, "vocab": 64, "chunk": 16, "reps": 1, "dtype": "float32", "out": "runs/bench_kernels_cpu"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KERNEL_MODULES = ("spectrain.kernels.attention_triton", "spectrain.kernels.draft_loss_triton",
                  "spectrain.kernels.lse_merge_triton")


def use_interpreter() -> None:
    """Without a GPU the Triton kernels run under the interpreter, which Triton reads when a kernel is defined."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    loaded = [m for m in KERNEL_MODULES if m in sys.modules]
    if loaded:
        raise ConfigError(f"bench kernels: no GPU here and {loaded} were already compiled-mode imports; run it in a "
                          f"fresh process, or set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"


def device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else machine_label()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run: Callable[[], None], device: torch.device, reps: int) -> dict:
    """Median wall time of `run` (after one warm-up call that also compiles) and its peak extra memory."""
    run()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
    return {"ms": 1e3 * statistics.median(times), "peak_mib": peak}


def packed_cu(tokens: int, doc_tokens: int, device: torch.device) -> torch.Tensor:
    """Documents of `doc_tokens` (the last one shorter), as GRPO batches pack them."""
    bounds = list(range(0, tokens, doc_tokens)) + [tokens]
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def attention_ops(device: torch.device) -> dict[str, object]:
    """The TTT trunk backends to compare; on CUDA a missing one is an error, never a silent gap."""
    from spectrain.kernels.attention_triton import TritonAttentionOps
    from spectrain.ops.attention import LocalAttentionOps

    ops = {"torch": LocalAttentionOps(use_fused=False), "triton": TritonAttentionOps()}
    if device.type == "cuda":
        from spectrain.ops.backends import build_attention_ops

        ops["varlen"] = build_attention_ops("varlen")
    return ops


def ttt_case(options: dict, tokens: int, ops, device: torch.device) -> Callable[[], None]:
    from spectrain.ops.ttt_attention import ttt_attention

    dtype, p = DTYPES[options["dtype"]], options["passes"]
    gen = torch.Generator(device=device).manual_seed(tokens)
    make = lambda heads: torch.randn(tokens, heads, options["head_dim"], device=device, dtype=dtype,  # noqa: E731
                                     generator=gen).requires_grad_()
    q = make(options["heads"])
    keys = [make(options["kv_heads"]) for _ in range(p)]
    values = [make(options["kv_heads"]) for _ in range(p)]
    cu = packed_cu(tokens, options["doc_tokens"], device)
    grad = torch.randn_like(q)

    def run() -> None:
        out = ttt_attention(q, keys, values, cu, ops=ops)
        torch.autograd.backward(out, grad)
        for t in (q, *keys, *values):
            t.grad = None

    return run


def loss_case(options: dict, tokens: int, impl: str, device: torch.device) -> Callable[[], None]:
    from spectrain.ops.draft_loss import draft_soft_ce

    dtype, vocab = DTYPES[options["dtype"]], options["vocab"]
    gen = torch.Generator(device=device).manual_seed(tokens)
    hidden = torch.randn(tokens, options["hidden"], device=device, dtype=dtype, generator=gen).requires_grad_()
    weight = (0.02 * torch.randn(vocab, options["hidden"], device=device, dtype=dtype, generator=gen)).requires_grad_()
    teacher = torch.randn(tokens, vocab, device=device, dtype=dtype, generator=gen)
    valid = torch.rand(tokens, device=device, generator=gen) < 0.9

    def run() -> None:
        loss = draft_soft_ce(hidden, weight, teacher, valid, impl=impl, chunk=options["chunk"]).sum()
        loss.backward()
        hidden.grad = weight.grad = None

    return run


def sweep(options: dict, device: torch.device) -> dict:
    rows = {"attention": [], "loss": []}
    for tokens in int_list("kernels", "tokens", options["tokens"]):
        for name, ops in attention_ops(device).items():
            rows["attention"].append({"tokens": tokens, "impl": name,
                                      **measure(ttt_case(options, tokens, ops, device), device, options["reps"])})
            print(f"[bench kernels] ttt attention {name:7s} {tokens:6d} tokens: {rows['attention'][-1]}")
        for impl in ("torch", "chunked", "triton"):
            rows["loss"].append({"tokens": tokens, "impl": impl,
                                 **measure(loss_case(options, tokens, impl, device), device, options["reps"])})
            print(f"[bench kernels] draft loss {impl:7s} {tokens:6d} tokens: {rows['loss'][-1]}")
    return rows


def ratio(rows: list[dict], key: str, num: str, den: str) -> dict[int, float | None]:
    """Per token count, `num`'s `key` over `den`'s (None where either was not measured)."""
    by = {(r["tokens"], r["impl"]): r[key] for r in rows}
    out = {}
    for tokens in sorted({r["tokens"] for r in rows}):
        a, b = by.get((tokens, num)), by.get((tokens, den))
        out[tokens] = a / b if a is not None and b else None
    return out


def series(rows: list[dict], key: str) -> dict:
    impls = dict.fromkeys(r["impl"] for r in rows)
    return {impl: ([r["tokens"] for r in rows if r["impl"] == impl], [r[key] for r in rows if r["impl"] == impl])
            for impl in impls}


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def write_report(out: Path, options: dict, device: torch.device, rows: dict) -> dict:
    speedup = ratio(rows["attention"], "ms", "torch", "triton")
    memory = ratio(rows["loss"], "peak_mib", "triton", "torch")
    result = {"options": options, "device": device_label(device), "machine": machine_label(), "rows": rows,
              "ttt_attention_speedup_triton_over_torch": speedup, "draft_loss_peak_memory_triton_over_torch": memory}
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(result, indent=1))
    panels = [("TTT attention fwd+bwd, ms", series(rows["attention"], "ms")),
              ("draft loss fwd+bwd, ms", series(rows["loss"], "ms"))]
    if device.type == "cuda":
        panels += [("TTT attention peak MiB", series(rows["attention"], "peak_mib")),
                   ("draft loss peak MiB", series(rows["loss"], "peak_mib"))]
    plot_panels(out / "kernels.png", f"kernels vs torch paths on {device_label(device)}", panels, xlabel="tokens",
                logx=True, logy=True)
    table = lambda rs: "\n".join(f"| {r['tokens']} | {r['impl']} | {r['ms']:.2f} | {fmt(r['peak_mib'], '.0f')} |"  # noqa: E731
                                 for r in rs)
    (out / "kernels.md").write_text(f"""# Kernels vs the torch paths

`spectrain bench kernels {' '.join(f'{k}={v}' for k, v in options.items())}` on {device_label(device)}
({machine_label()}). Forward + backward, median of {options['reps']} after a warm-up; peak memory is CUDA's
allocator peak above the inputs.

TTT attention of pass {options['passes']}: Triton speed-up over the torch path by tokens:
{', '.join(f"{t}: {fmt(s, '.2f')}x" for t, s in speedup.items())}.
Draft loss, Triton peak memory / dense torch peak memory (vocabulary {options['vocab']}):
{', '.join(f"{t}: {fmt(m, '.3f')}" for t, m in memory.items())}.

| tokens | TTT attention | ms | peak MiB |
|---|---|---|---|
{table(rows['attention'])}

| tokens | draft loss | ms | peak MiB |
|---|---|---|---|
{table(rows['loss'])}

![kernels](kernels.png)
""")
    return result


def parse(args: list[str], device: torch.device) -> dict:
    """The options on `device` (a CPU run is a dry run at tiny sizes: other defaults), checked before anything runs."""
    options = parse_options("kernels", args, DEFAULTS if device.type == "cuda" else CPU_DEFAULTS)
    if options["dtype"] not in DTYPES:
        raise ConfigError(f"bench kernels: dtype={options['dtype']!r}; use one of {', '.join(DTYPES)}")
    return options


def main(args: list[str]) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = parse(args, device)
    if device.type == "cpu":
        print("[bench kernels] no GPU: a correctness dry run at tiny sizes, Triton under the interpreter (the "
              "timings mean nothing; the real benchmark runs on a GPU: scripts/gpu_check.sh)")
        use_interpreter()
    result = write_report(Path(options["out"]), options, device, sweep(options, device))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1, default=str))
    return 0

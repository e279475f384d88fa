"""Attention backends behind the ``(out, lse)`` ops seam, chosen by ``policy.attention_backend``.

Every backend has ``forward(q, k, v, cu_q, cu_k, causal, scale) -> (out, lse)`` and
``backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale) -> (dq, dk, dv)`` with the JOINT
statistics semantics of docs/dev/contracts.md, so any of them is the policy's attention, the
draft's TTT trunk and the local block of the zigzag ring.

=========== ========================= ================= =============================== ====
backend     runs on                   dtypes            backward                        CP
=========== ========================= ================= =============================== ====
torch       CPU, CUDA (blockwise)     any; fp64 exact   blockwise, from (out, lse)      yes
varlen      CUDA sm80+ (in torch)     fp16, bf16 [1]_   torch's flash kernel            yes
flex        CUDA compiled, CPU eager  fp16, bf16, fp32  recompute [2]_ [3]_             yes
triton      CUDA; CPU interpreter     fp16, bf16, fp32  Triton kernels, from (out, lse) yes
flash_attn  CUDA, when installed [5]_ fp16, bf16 [1]_   flash-attn, from (out, lse)     yes
te          CUDA, when installed [5]_ fp16, bf16 [1]_   recompute [3]_                  no [4]_
=========== ========================= ================= =============================== ====

``auto`` resolves per device on the first call: CPU -> torch; CUDA -> the fastest of flash_attn (if
installed), varlen and triton, timed forward + backward on that call's own tensors (16-bit-only
kernels are skipped for float32 runs; flex only when none of them can run).

.. [1] 16-bit kernels. In a bf16 run (``policy.dtype=bfloat16``) attention sees float32 q/k/v
   (rotary tables promote them under autocast): they are computed in bf16 (``half_dtype``).
.. [2] torch has no flex backward on CPU: there the recompute uses the same mask densely.
.. [3] No entry point takes given ``(out, lse)``: the part is recomputed under autograd and fed
   the gradients the joint merge implies (``recompute_backward``).
.. [4] TE returns no LSE: it is read off a sink key (``_lse_by_sink``), at the output's 16-bit
   precision only, too coarse for the ring's merges.
.. [5] ``pip install -e ".[flash-attn]"`` / ``pip install -e ".[transformer-engine]"`` (both compile
   against the CUDA toolkit for a long time); nothing else needs them. The CPU interpreter
   (``TRITON_INTERPRET=1``) is for tests.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from spectrain.config.schema import ATTENTION_BACKENDS as BACKENDS
from spectrain.ops.attention import LocalAttentionOps
from spectrain.ops.backend_ops import (
    INSTALL,
    FlashAttnOps,
    FlexOps,
    TransformerEngineOps,
    VarlenOps,
    backend_error,
    import_installed,
    installed,
    kernel_dtype,
)

FLASH_KERNELS = ("varlen", "flash_attn", "te")  # CUDA-only fp16 / bf16 kernels


def _triton_ops(half_dtype: torch.dtype | None = None):
    from spectrain.kernels.attention_triton import TritonAttentionOps

    return TritonAttentionOps(half_dtype=half_dtype)


def _varlen_runs_here() -> bool:
    """torch's varlen flash kernels: this torch has them and the GPU is sm80+ (what they are built for)."""
    return (importlib.util.find_spec("torch.nn.attention.varlen") is not None
            and torch.backends.cuda.is_flash_attention_available() and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (8, 0))


def _triton_runs_here(device_type: str) -> bool:
    return importlib.util.find_spec("triton") is not None and (
        device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def auto_candidates(device_type: str, half_dtype: torch.dtype | None) -> tuple[list[str], str]:
    """The backends `auto` chooses among on `device_type` (the fastest, timed at the first call), and why these."""
    if device_type != "cuda":
        return ["torch"], f"{device_type}: the blockwise torch ops (the flash backends are CUDA-only)"
    names, notes = [], []
    if half_dtype is None:
        notes.append("a float32 run skips the 16-bit flash kernels")
    else:
        if installed("flash_attn"):
            names.append("flash_attn")
        if _varlen_runs_here():
            names.append("varlen")
        else:
            notes.append("torch's varlen flash kernels need an sm80+ GPU and a torch built with them")
    if _triton_runs_here(device_type):
        names.append("triton")
    return names or ["flex"], "; ".join(["cuda", *notes])


def time_backend(ops, q, k, v, cu_q, cu_k, causal, scale, reps: int = 3) -> float:
    """Median seconds of one forward + backward of `ops` on a call's own tensors (after a warm-up that compiles)."""
    def once() -> float:
        start = time.perf_counter()
        out, lse = ops.forward(q, k, v, cu_q, cu_k, causal, scale)
        ops.backward(out, q, k, v, out, lse, cu_q, cu_k, causal, scale)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(reps))


def fastest(names: list[str], half_dtype: torch.dtype | None, *call) -> tuple[str, dict[str, float]]:
    """The backend among `names` that runs `call` (q, k, v, cu_q, cu_k, causal, scale) fastest, and every timing.

    A candidate that fails here (a kernel this GPU or these shapes cannot take) is left out, and said so; the
    last one's error is raised when none runs."""
    timings: dict[str, float] = {}
    error: Exception | None = None
    for name in names:
        try:
            timings[name] = time_backend(build_attention_ops(name, half_dtype), *call)
        except Exception as exc:  # any kernel failure: the next candidate may run
            error = exc
            _say_once(f"[spectrain] policy.attention_backend=auto: {name} left out ({type(exc).__name__}: {exc})")
    if not timings:
        assert error is not None  # `names` is not empty
        raise error
    return min(timings, key=timings.__getitem__), timings


def check_attention_backend(name: str, device_type: str, half_dtype: torch.dtype | None = None) -> str:
    """Fail at start-up, not mid-step, when backend `name` cannot run on `device_type` ("cpu" / "cuda");
    returns the backend it runs (`auto` resolved). `half_dtype`: see `build_attention_ops`."""
    if name not in BACKENDS:
        raise backend_error(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        names, _ = auto_candidates(device_type, half_dtype)
        return names[0] if len(names) == 1 else f"the fastest of {', '.join(names)} (timed at the first call)"
    if name in INSTALL:
        import_installed(name)
    if name in FLASH_KERNELS:
        if device_type != "cuda":
            raise backend_error(f"{name} runs on CUDA only and this run trains on {device_type} "
                                f"(trainer.accelerator); use torch or auto on {device_type}")
        kernel_dtype(torch.float32, half_dtype, name)  # a float32 run: refused
    if name == "varlen" and not _varlen_runs_here():
        raise backend_error("varlen needs torch's flash kernels (torch >= 2.11 built with CUDA, an sm80+ GPU); "
                            "use flex or triton")
    if name == "triton" and not _triton_runs_here(device_type):
        raise backend_error(f"triton runs on CUDA, or on CPU under TRITON_INTERPRET=1 (tests only); on "
                            f"{device_type} use torch or auto")
    return name


@functools.cache
def _say_once(message: str) -> None:
    """Once per process: the policy and its frozen KL reference each hold an `auto` ops object."""
    print(message, file=sys.stderr, flush=True)


class AutoAttentionOps:
    """`auto`: per device type, the fastest available backend, timed on the first call's own tensors (forward
    and backward), and said once on stderr with the timings; later calls on that device go straight to it."""

    def __init__(self, half_dtype: torch.dtype | None = None) -> None:
        self.half_dtype = half_dtype
        self.resolved: dict[str, object] = {}

    @property
    def supports_context_parallel(self) -> bool:
        return all(getattr(ops, "supports_context_parallel", True) for ops in self.resolved.values())

    def ops_for(self, q, k, v, cu_q, cu_k, causal, scale=None):
        device = q.device.type
        if device not in self.resolved:
            names, why = auto_candidates(device, self.half_dtype)
            name, timings = (names[0], {}) if len(names) == 1 else fastest(names, self.half_dtype, q.detach(),
                                                                          k.detach(), v.detach(), cu_q, cu_k,
                                                                          causal, scale)
            timed = ", ".join(f"{n} {1e3 * t:.2f} ms" for n, t in timings.items())
            _say_once(f"[spectrain] policy.attention_backend=auto -> {name} ({why}{'; ' + timed if timed else ''})")
            self.resolved[device] = build_attention_ops(name, self.half_dtype)
        return self.resolved[device]

    def ttt_ops(self, device: torch.device):
        """On CUDA the draft's TTT attention takes the fused Triton trunk + branch kernel, whatever the trunk's
        backend (one kernel instead of trunk, branch and merge); elsewhere the trunk's own path."""
        if device.type != "cuda" or importlib.util.find_spec("triton") is None:
            return None
        if "ttt" not in self.resolved:
            _say_once("[spectrain] policy.attention_backend=auto -> "
                      "the draft's TTT attention on the fused Triton kernel")
            self.resolved["ttt"] = _triton_ops(self.half_dtype)
        return self.resolved["ttt"]

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        return self.ops_for(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale).forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        return self.ops_for(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale).backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale)


def build_attention_ops(name: str, half_dtype: torch.dtype | None = None):
    """The ops object of `policy.attention_backend = name`.

    `half_dtype`: what the 16-bit-only kernels (varlen, flash_attn, te) compute float32 inputs in; a bf16
    run passes torch.bfloat16 (its attention sees float32 q/k/v), a float32 run None (they refuse them).
    """
    if name == "auto":
        return AutoAttentionOps(half_dtype)
    builders: dict[str, Callable[[], object]] = {
        "torch": LocalAttentionOps, "flex": FlexOps, "triton": lambda: _triton_ops(half_dtype),
        "varlen": lambda: VarlenOps(half_dtype), "flash_attn": lambda: FlashAttnOps(half_dtype),
        "te": lambda: TransformerEngineOps(half_dtype)}
    if name not in builders:
        raise backend_error(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return builders[name]()

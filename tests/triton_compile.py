"""Compile every Triton kernel for a real GPU target on a machine without one, and read its resource use.

The interpreter (``TRITON_INTERPRET=1``, what the CPU tests run) accepts programs that the compiler
rejects (``tl.dot`` shapes or dtypes, scalar promotion) and says nothing about shared memory or
register spills. Here the PUBLIC wrappers run on small CPU tensors of the real dtypes and head sizes
under an offline driver whose target is the GPU's: Triton specializes each launch exactly as it would on
the GPU, the JIT hook records it and skips the launch, and every recorded launch is then compiled
down to a cubin with ``ptxas -v``. Must run with ``TRITON_INTERPRET`` unset, before any kernel module
is imported (the kernels pick interpreter or compiler when they are decorated).

    python -m tests.triton_compile [--arch 90] [--json] [--cases "bf16 d128" ...]
"""

import argparse
import contextlib
import io
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import driver

MAX_SHARED = {90: 232448, 80: 166912}  # max dynamic shared memory per block (bytes): H100/H200, A100
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores")


@dataclass
class Launch:
    """One kernel specialization as a wrapper launched it: what ``triton.compile`` needs."""

    kernel: triton.JITFunction
    case: str
    signature: dict
    constexprs: dict
    attrs: dict
    num_warps: int
    num_stages: int

    @property
    def key(self) -> tuple:
        return (self.kernel.fn.__name__, str(self.signature), str(self.constexprs), str(self.attrs), self.num_warps,
                self.num_stages)

    @property
    def dtype(self) -> str:
        """The dtype of the kernel's first tensor (q, hidden, or out)."""
        return self.signature[self.kernel.arg_names[0]].lstrip("*")


class _OfflineDriver:
    """Just enough of a Triton driver for ``JITFunction.run`` to specialize and key a launch for ``target``."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@contextlib.contextmanager
def _recording(target: GPUTarget, case: str, launches: list[Launch]):
    """Wrapper calls inside record their kernel launches in ``launches`` and launch nothing (outputs stay
    uninitialised: only the kernels' specializations are of interest)."""

    def hook(*, fn, compile, **_):
        launches.append(Launch(fn.jit_function, case, compile["signature"], compile["constants"],
                               compile["configs"][0], compile["num_warps"], compile["num_stages"]))
        return True  # "handled": JITFunction.run then neither compiles nor launches

    previous = driver._active  # None until first used; reset_active() would look for a real GPU
    driver.set_active(_OfflineDriver(target))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = None
        driver.set_active(previous)


# ----------------------------------------------------------------------------- the wrapper calls

TOKENS = 256  # two documents: [0, 100) and [100, 256)


def _packed(heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(TOKENS, heads, head_dim, dtype=dtype)


def _cu_seqlens() -> torch.Tensor:
    return torch.tensor([0, 100, TOKENS], dtype=torch.int32)


def _attention(dtype: torch.dtype, head_dim: int, causal: bool, heads: int = 32, kv_heads: int = 8) -> None:
    from spectrain.kernels.attention_triton import triton_attn_backward, triton_attn_forward

    q, k, v = _packed(heads, head_dim, dtype), _packed(kv_heads, head_dim, dtype), _packed(kv_heads, head_dim, dtype)
    out, lse = triton_attn_forward(q, k, v, _cu_seqlens(), _cu_seqlens(), causal)
    triton_attn_backward(torch.empty_like(out), q, k, v, out, lse, _cu_seqlens(), _cu_seqlens(), causal)


def _ttt(dtype: torch.dtype, head_dim: int, passes: int = 3, heads: int = 32, kv_heads: int = 8) -> None:
    from spectrain.kernels.attention_triton import triton_ttt_backward, triton_ttt_forward

    q = _packed(heads, head_dim, dtype)
    keys = [_packed(kv_heads, head_dim, dtype) for _ in range(passes)]
    values = [_packed(kv_heads, head_dim, dtype) for _ in range(passes)]
    out, lse = triton_ttt_forward(q, keys, values, _cu_seqlens())
    triton_ttt_backward(torch.empty_like(out), q, keys, values, out, lse, _cu_seqlens())


def _merge(dtype: torch.dtype, block_dtype: torch.dtype, head_dim: int = 128) -> None:
    """Ring attention's merge: the running fp32 result with a block's (its own dtype), forward and backward."""
    from spectrain.kernels.lse_merge_triton import triton_merge_attn

    out, block_out = _packed(32, head_dim, dtype), _packed(32, head_dim, block_dtype)
    lse, block_lse = torch.zeros(TOKENS, 32), torch.zeros(TOKENS, 32)
    inputs = [t.requires_grad_() for t in (out, lse, block_out, block_lse)]
    merged, merged_lse = triton_merge_attn(*inputs)
    torch.autograd.backward((merged, merged_lse), (torch.empty_like(merged), torch.empty_like(merged_lse)))


def _draft_loss(dtype: torch.dtype, teacher_dtype: torch.dtype, hidden: int = 4096, vocab: int = 32000) -> None:
    """The fused draft loss at a Llama-3-8B-like head: forward and one chunk's dlogits."""
    from spectrain.kernels.draft_loss_triton import soft_ce_dlogits, soft_ce_forward

    h, w = torch.empty(TOKENS, hidden, dtype=dtype), torch.empty(vocab, hidden, dtype=dtype)  # untouched: lazy
    teacher = torch.empty(TOKENS, vocab, dtype=teacher_dtype)
    _, _, lse_z, lse_t = soft_ce_forward(h, w, teacher)
    soft_ce_dlogits(h, w, teacher, torch.zeros_like(lse_z), lse_z, lse_t)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (name, call): the dtypes and sizes the GPU tests and the kernel benchmark run (32 q / 8 kv heads, head_dim 128).
CASES = {
    "attn bf16 d128 causal": lambda: _attention(BF16, 128, True),
    "attn bf16 d128 cross": lambda: _attention(BF16, 128, False),
    "attn bf16 d64 causal": lambda: _attention(BF16, 64, True, heads=8, kv_heads=2),
    "attn fp16 d128 causal": lambda: _attention(FP16, 128, True),
    "attn fp32 d128 causal": lambda: _attention(FP32, 128, True),
    "attn fp32 d96 causal": lambda: _attention(FP32, 96, True, heads=4, kv_heads=2),
    "ttt bf16 d128 P3": lambda: _ttt(BF16, 128),
    "ttt bf16 d64 P2": lambda: _ttt(BF16, 64, passes=2, heads=8, kv_heads=2),
    "ttt fp32 d128 P3": lambda: _ttt(FP32, 128),
    "merge fp32+bf16": lambda: _merge(FP32, BF16),
    "merge fp32": lambda: _merge(FP32, FP32),
    "loss bf16": lambda: _draft_loss(BF16, BF16),
    "loss fp32 teacher bf16": lambda: _draft_loss(FP32, BF16),
}


def record_launches(target: GPUTarget, cases: dict = CASES) -> list[Launch]:
    """Every distinct kernel specialization the wrapper calls of ``cases`` launch, in launch order."""
    assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET: the interpreter compiles nothing"
    launches: list[Launch] = []
    for case, call in cases.items():
        with _recording(target, case, launches):
            call()
    unique = {}
    for launch in launches:
        unique.setdefault(launch.key, launch)
    return list(unique.values())


# ----------------------------------------------------------------------------- compiling

def compile_launch(launch: Launch, target: GPUTarget) -> dict:
    """Compile one launch to a cubin: kernel, case, dtype, shared bytes, registers, spill stores, warps, stages."""
    src = ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs)
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    log, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(log), knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v: "Used N registers, ..., M bytes spill stores"
        compiled = triton.compile(src, target=target, options=options)
    regs, spills = _PTXAS_REGS.search(log.getvalue()), _PTXAS_SPILLS.search(log.getvalue())
    assert regs and spills, f"no ptxas resource lines for {launch.kernel.fn.__name__}:\n{log.getvalue()}"
    constexprs = {launch.kernel.arg_names[path[0]]: value for path, value in launch.constexprs.items()}
    return dict(kernel=launch.kernel.fn.__name__, case=launch.case, dtype=launch.dtype,
                shared=compiled.metadata.shared, regs=int(regs[1]), spills=int(spills[1]),
                num_warps=launch.num_warps, num_stages=launch.num_stages, constexprs=constexprs,
                seconds=round(time.perf_counter() - start, 1))


def compile_all(target: tuple[int, int] = (90, 32), cases: dict = CASES) -> list[dict]:
    """Compile every kernel the wrappers launch in ``cases`` for ``GPUTarget("cuda", *target)``:
    one dict (kernel, case, dtype, shared, regs, spills, ...) per distinct specialization. A fresh
    Triton cache, so that every kernel really goes through ptxas."""
    gpu = GPUTarget("cuda", *target)
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope():
        knobs.cache.dir = cache
        return [compile_launch(launch, gpu) for launch in record_launches(gpu, cases)]


def format_table(rows: list[dict]) -> str:
    lines = [f"{'kernel':18} {'case':24} {'dtype':5} {'shared':>7} {'regs':>4} {'spills':>6} warps stages"]
    lines += [f"{r['kernel']:18} {r['case']:24} {r['dtype']:5} {r['shared']:7d} {r['regs']:4d} {r['spills']:6d} "
              f"{r['num_warps']:5d} {r['num_stages']:6d}" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability: 90 (H100/H200) or 80 (A100)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--cases", nargs="+", help="only the cases whose name contains one of these")
    args = parser.parse_args()
    cases = {name: call for name, call in CASES.items() if not args.cases or any(c in name for c in args.cases)}
    rows = compile_all((args.arch, 32), cases)
    print(json.dumps(rows, default=str) if args.json else format_table(rows))
    over = [r for r in rows if r["shared"] > MAX_SHARED.get(args.arch, MAX_SHARED[80])]
    raise SystemExit(f"over the shared-memory limit: {over}" if over else 0)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # before the kernel modules are imported (the calls import them)
    main()

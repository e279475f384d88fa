"""Every Triton kernel compiles for the GPU (sm_90, sm_80) exactly as its wrapper launches it, fits in shared
memory, and does not spill registers where it matters, checked on a machine without a GPU.

The rest of the suite runs the kernels under ``TRITON_INTERPRET=1``, which accepts what the compiler rejects
and never sees shared memory or registers. The compile runs in a subprocess: this session has the
interpreter on (tests/conftest.py), and the kernels pick it when their module is imported.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_compile import MAX_SHARED

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"_fwd", "_bwd_dq", "_bwd_dkdv", "_bwd_branch_dkdv", "_merge_fwd", "_merge_bwd", "_soft_ce_fwd",
           "_soft_ce_bwd"}  # every @triton.jit kernel of kernels/ that a wrapper launches


def compile_rows(arch: int, *cases: str) -> list[dict]:
    """``compile_all`` for ``sm_{arch}`` in a process without the interpreter (its JSON rows)."""
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; set, so that it does not warn
    command = [sys.executable, "-m", "tests.triton_compile", "--arch", str(arch), "--json"]
    proc = subprocess.run(command + (["--cases", *cases] if cases else []), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout)


def over_shared(rows: list[dict], arch: int) -> list[dict]:
    return [r for r in rows if r["shared"] > MAX_SHARED[arch]]


def spilled_in_16_bit(rows: list[dict]) -> list[dict]:
    """16-bit inputs are the GPU's fast path: no spill at head_dim 128 or 64, nor in the draft loss."""
    return [r for r in rows if r["spills"] and r["dtype"] != "fp32"]


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_without_spilling_in_16_bit():
    rows = compile_rows(90)
    assert {r["kernel"] for r in rows} == KERNELS
    assert {r["dtype"] for r in rows} == {"bf16", "fp16", "fp32"}
    assert [r["kernel"] for r in rows if r["case"] == "attn bf16 d128 causal"] == ["_fwd", "_bwd_dq", "_bwd_dkdv"]
    assert over_shared(rows, 90) == []
    assert spilled_in_16_bit(rows) == []
    # float32 (an ieee tl.dot runs on the FMA units; a correctness path): at most a few spilled registers
    assert [r for r in rows if r["spills"] > 64] == []


@pytest.mark.slow
def test_bf16_kernels_compile_for_ampere_within_its_shared_memory_without_spilling():
    rows = compile_rows(80, "bf16 d128", "loss bf16", "merge fp32+bf16")
    assert {r["kernel"] for r in rows} == KERNELS
    assert over_shared(rows, 80) == []
    assert spilled_in_16_bit(rows) == []

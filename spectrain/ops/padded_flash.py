"""Causal packed attention through torch's fused CPU flash kernel, by padding documents.

GRPO batches are many short documents of similar length: padding them to `[B, H, S, D]`
and calling `aten._scaled_dot_product_flash_attention_for_cpu` (which returns the
logsumexp, and whose backward takes a given `(out, lse)`, so joint statistics work) is an
order of magnitude faster on CPU than the blockwise plain-torch path. `LocalAttentionOps`
uses it only when padding wastes little; long uneven documents stay blockwise.
"""
from __future__ import annotations

import torch

MAX_PADDING_RATIO = 1.5  # padded tokens / real tokens above which the blockwise path wins


def usable(q: torch.Tensor, cu: list[int]) -> bool:
    """CPU tensors and little padding (the kernel exists for CPU only)."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    return q.device.type == "cpu" and max(lengths) * len(lengths) <= MAX_PADDING_RATIO * max(cu[-1], 1)


def _pad_layout(cu: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index `[B, S]` into the packed tensor and its validity mask."""
    starts = torch.tensor(cu[:-1], device=device)
    lengths = torch.tensor(cu[1:], device=device) - starts
    cols = torch.arange(int(lengths.max()), device=device)
    valid = cols[None, :] < lengths[:, None]
    index = (starts[:, None] + cols[None, :]).clamp_max(max(cu[-1] - 1, 0))
    return index, valid


def _pad(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    """`[T, H, D] -> [B, H', S, D]` (zeros on padding; kv heads repeated to `heads` for GQA)."""
    padded = x[index] * valid[:, :, None, None].to(x.dtype)
    padded = padded.transpose(1, 2)
    if heads is not None and heads != x.shape[1]:
        padded = padded.repeat_interleave(heads // x.shape[1], dim=1)
    return padded


def _unpad(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`[B, H, S, ...] -> [T, H, ...]` in packed order."""
    return x.transpose(1, 2)[valid]


def forward(q, k, v, cu: list[int], scale: float | None):
    index, valid = _pad_layout(cu, q.device)
    heads = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _pad(q, index, valid), _pad(k, index, valid, heads), _pad(v, index, valid, heads), 0.0, True, scale=scale)
    return _unpad(out, valid).to(q.dtype), _unpad(lse, valid)


def backward(dout, q, k, v, out, lse, cu: list[int], scale: float | None):
    index, valid = _pad_layout(cu, q.device)
    heads, kv_heads = q.shape[1], k.shape[1]
    lse_padded = (lse.to(torch.promote_types(lse.dtype, q.dtype))[index] * valid[:, :, None]).transpose(1, 2)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _pad(dout, index, valid), _pad(q, index, valid), _pad(k, index, valid, heads),
        _pad(v, index, valid, heads), _pad(out, index, valid), lse_padded.contiguous(), 0.0, True, scale=scale)
    if kv_heads != heads:  # GQA: a kv head's gradient is the sum over the query heads it serves
        b, _, s, d = dk.shape
        dk = dk.view(b, kv_heads, heads // kv_heads, s, d).sum(2)
        dv = dv.view(b, kv_heads, heads // kv_heads, s, d).sum(2)
    return _unpad(dq, valid).to(q.dtype), _unpad(dk, valid).to(k.dtype), _unpad(dv, valid).to(v.dtype)

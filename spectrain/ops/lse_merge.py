"""Merging partial attention results by their log-sum-exp.

Two softmax-attention results over disjoint key sets, ``(out_a, lse_a)`` and
``(out_b, lse_b)``, combine exactly into the result over the union:
``lse = logaddexp(lse_a, lse_b)`` and ``out = e^{lse_a-lse} out_a + e^{lse_b-lse} out_b``.
Ring attention (one part per ring step) and TTT branch attention (trunk + branch) both
rely on this, so it lives here once, in its numerically safe form.
"""

import torch
import torch.nn.functional as F


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: the merge never runs in 16 bits."""
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def merge_attn(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the partial result ``(block_out, block_lse)`` into ``(out, lse)``.

    Shapes: ``out, block_out [T, H, D]``, ``lse, block_lse [T, H]``. ``out=lse=None``
    starts an accumulation (first block). Returns new float32 tensors (float64 if an
    input is float64); nothing is modified in place, so it is safe under autograd.

    Uses ``out - sigmoid(lse_b - lse) (out - out_b)`` and ``lse - logsigmoid(lse - lse_b)``
    instead of exponentials of differences, which overflow. Rows with ``lse = -inf``
    (no visible key) on either side take the other side unchanged; the sigmoid terms
    only ever see finite arguments, so neither the forward nor the backward makes NaN.
    On CUDA the merge of two tensors runs as one Triton kernel each way
    (``spectrain.kernels.lse_merge_triton``, the same formulas).
    """
    if out is None or lse is None:
        if out is not None or lse is not None:
            raise ValueError("out and lse must both be None or both be tensors")
        dtype = _acc_dtype(block_out, block_lse)
        return block_out.to(dtype), block_lse.to(dtype)
    if block_out.is_cuda:
        from spectrain.kernels.lse_merge_triton import triton_merge_attn  # Triton: only needed on the GPU

        return triton_merge_attn(out, lse, block_out, block_lse)
    assert out.shape == block_out.shape and out.dim() == 3, (out.shape, block_out.shape)
    assert lse.shape == block_lse.shape == out.shape[:2], (lse.shape, block_lse.shape)

    dtype = _acc_dtype(out, lse, block_out, block_lse)
    out, lse = out.to(dtype), lse.to(dtype)
    block_out, block_lse = block_out.to(dtype), block_lse.to(dtype)

    empty = lse == float("-inf")
    block_empty = block_lse == float("-inf")
    # lse - lse_b with the empty cases replaced by 0 so every branch below stays finite.
    diff = torch.where(empty | block_empty, 0.0, lse - block_lse)

    merged_out = out - torch.sigmoid(-diff).unsqueeze(-1) * (out - block_out)
    merged_lse = lse - F.logsigmoid(diff)

    new_out = torch.where(
        block_empty.unsqueeze(-1), out, torch.where(empty.unsqueeze(-1), block_out, merged_out)
    )
    new_lse = torch.where(block_empty, lse, torch.where(empty, block_lse, merged_lse))
    return new_out, new_lse

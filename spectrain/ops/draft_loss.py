"""The draft's lm_head + soft cross-entropy against the teacher, with and without [T, Vd] logits.

Per token row: ``ce = -sum_j softmax(t)_j log_softmax(h W^T)_j`` over the draft vocabulary,
``h`` the draft's normed hidden state, ``W`` its lm_head, ``t`` the policy's logits restricted
to the draft vocabulary. Three implementations (`draft.loss_kernel`), equal in value, top-1 and
gradients:

- ``torch``: dense, the reference: the whole ``[T, Vd]`` logits, upcast to fp32 with
  their log-softmax and the teacher's softmax beside them (the peak of a draft update).
- ``chunked``: an autograd.Function that applies the dense formula to ``chunk`` rows at a
  time and keeps only per-row log-sum-exps; the backward recomputes each chunk's logits.
  Memory O(chunk x Vd), any device.
- ``triton``: the same split into Triton kernels (`spectrain.kernels.draft_loss_triton`):
  the forward never writes logits at all (online log-sum-exp over vocabulary tiles); the
  backward writes one chunk's logits gradient and turns it into the hidden-state and
  lm_head gradients with torch matmuls.

``auto`` is ``triton`` on CUDA and ``torch`` elsewhere.

The teacher may be read through a row index (``rows``): TTT pass d scores draft row i against
teacher row i + d, and reading the one teacher tensor at those rows spares a shifted ``[T, Vd]``
copy per pass that the backward would otherwise keep alive until the end of the update.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from spectrain.errors import ConfigError

DEFAULT_CHUNK = 1024  # rows per chunk: a [1024, 32K] fp32 logits chunk is 125 MiB


def loss_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: the softmaxes never run in 16 bits."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def soft_ce_rows(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Dense soft CE of every row `[T]`: the teacher's softmax against the draft's log-softmax."""
    dtype = loss_dtype(logits, teacher_logits)
    return -(F.softmax(teacher_logits.to(dtype), dim=-1) * F.log_softmax(logits.to(dtype), dim=-1)).sum(-1)


def dense_soft_ce_top1(logits: torch.Tensor, teacher_logits: torch.Tensor,
                       valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: soft CE per row `[T]` (0 where not `valid`) and the argmax of `logits` `[T]`."""
    return torch.where(valid, soft_ce_rows(logits, teacher_logits), 0.0), logits.detach().argmax(-1)


def resolve_loss_kernel(impl: str, device: torch.device) -> str:
    """`draft.loss_kernel` for tensors on `device`: `auto` picks triton on CUDA, torch elsewhere."""
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if impl not in ("torch", "chunked", "triton"):
        raise ConfigError(f"draft.loss_kernel={impl!r} is not a loss kernel: use auto, torch, chunked or triton")
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("draft.loss_kernel=triton needs the draft on a CUDA GPU (or TRITON_INTERPRET=1 set before "
                          "start-up, for tests); use draft.loss_kernel=auto or chunked on CPU")
    return impl


def row_chunks(n_rows: int, chunk: int) -> Iterator[slice]:
    """Consecutive slices of at most `chunk` rows covering `n_rows` (also `ops.chunked_logprobs`'s loop)."""
    for start in range(0, n_rows, chunk):
        yield slice(start, min(start + chunk, n_rows))


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One chunk's logits, as the dense path computes them (matmul in the weights' dtype, then upcast)."""
    return F.linear(hidden, weight).to(dtype)


def _chunked_forward(hidden, weight, teacher, teacher_rows, chunk: int) -> tuple[torch.Tensor, ...]:
    """(ce, top1, lse_z, lse_t) per row, `chunk` rows of logits (and gathered teacher rows) at a time."""
    dtype = loss_dtype(hidden, teacher)
    n_rows = hidden.shape[0]
    ce, lse_z, lse_t = (hidden.new_empty(n_rows, dtype=dtype) for _ in range(3))
    top1 = hidden.new_empty(n_rows, dtype=torch.long)
    for rows in row_chunks(n_rows, chunk):
        logits, target = chunk_logits(hidden[rows], weight, dtype), teacher[teacher_rows[rows]].to(dtype)
        ce[rows], top1[rows] = soft_ce_rows(logits, target), logits.argmax(-1)
        lse_z[rows], lse_t[rows] = logits.logsumexp(-1), target.logsumexp(-1)
    return ce, top1, lse_z, lse_t


def _chunked_dlogits(hidden, weight, teacher, grad, lse_z, lse_t, *, rows) -> torch.Tensor:
    """`grad (softmax(z) - softmax(t))` of one chunk of rows (teacher rows `rows`), the logits recomputed."""
    z, t = chunk_logits(hidden, weight, grad.dtype), teacher[rows].to(grad.dtype)
    return grad[:, None] * (torch.exp(z - lse_z[:, None]) - torch.exp(t - lse_t[:, None]))


def head_grads(hidden: torch.Tensor, weight: torch.Tensor, chunk: int,
               dlogits: Callable[[slice], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the hidden states and the lm_head from one `[chunk, V]` logits gradient at a time.

    The weight gradient accumulates in fp32 (fp64 for fp64 weights) across chunks.
    """
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=loss_dtype(weight))
    for rows in row_chunks(hidden.shape[0], chunk):
        dz = dlogits(rows).to(weight.dtype)
        grad_hidden[rows] = dz @ weight
        grad_weight += dz.T @ hidden[rows]
    return grad_hidden, grad_weight.to(weight.dtype)


def _triton_ops():
    from spectrain.kernels import draft_loss_triton  # Triton is needed only where this path runs

    return draft_loss_triton


class _FusedSoftCE(torch.autograd.Function):
    """Soft CE per row from `hidden`, `weight` and the teacher at `teacher_rows`, never holding more than a
    chunk of logits; the backward keeps the caller's teacher and the row index, no copy of either."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher, teacher_rows, valid, impl: str, chunk: int):
        if impl == "triton":
            ce, top1, lse_z, lse_t = _triton_ops().soft_ce_forward(hidden, weight, teacher, rows=teacher_rows)
        else:
            ce, top1, lse_z, lse_t = _chunked_forward(hidden, weight, teacher, teacher_rows, chunk)
        ctx.save_for_backward(hidden, weight, teacher, teacher_rows, valid, lse_z, lse_t)
        ctx.impl, ctx.chunk = impl, chunk
        ctx.mark_non_differentiable(top1)
        return torch.where(valid, ce, 0.0), top1

    @staticmethod
    def backward(ctx, grad_ce, _grad_top1):
        hidden, weight, teacher, teacher_rows, valid, lse_z, lse_t = ctx.saved_tensors
        grad = torch.where(valid, grad_ce.to(lse_z.dtype), 0.0)
        kernel = _triton_ops().soft_ce_dlogits if ctx.impl == "triton" else _chunked_dlogits

        def dlogits(rows: slice) -> torch.Tensor:
            return kernel(hidden[rows], weight, teacher, grad[rows], lse_z[rows], lse_t[rows], rows=teacher_rows[rows])

        grad_hidden, grad_weight = head_grads(hidden, weight, ctx.chunk, dlogits)
        return grad_hidden, grad_weight, None, None, None, None, None


def draft_soft_ce_top1(hidden: torch.Tensor, weight: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor,
                       *, impl: str = "auto", chunk: int = DEFAULT_CHUNK,
                       rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row soft CE `[T]` (0 where not `valid`; fp32, fp64 for fp64 inputs) and the draft's top-1 id `[T]`.

    Args:
        hidden: the draft's normed hidden states `[T, H]` (differentiable).
        weight: its lm_head `[Vd, H]` (differentiable), same dtype as `hidden`.
        teacher_logits: the policy's logits restricted to the draft vocabulary, `[T, Vd]` (or
            `[N, Vd]` with `rows`), in their own dtype (bf16 stays bf16: each path upcasts at
            most a chunk); no gradient.
        valid: bool `[T]`, the rows that count.
        impl: `draft.loss_kernel` (auto | torch | chunked | triton).
        chunk: rows of logits (or of their gradient) held at once by `chunked` and `triton`.
        rows: int64 `[T]`, the teacher row of each draft row (each in `[0, N)`; any such index
            where `valid` is False); default: row i. `chunked` and `triton` read the teacher
            through it and save only it beside the caller's teacher for the backward.
    """
    assert valid.shape == hidden.shape[:1] and valid.dtype == torch.bool, (valid.shape, valid.dtype)
    assert chunk >= 1, chunk
    impl = resolve_loss_kernel(impl, hidden.device)
    teacher_logits = teacher_logits.detach()
    if impl == "torch":
        teacher = teacher_logits if rows is None else teacher_logits[rows]
        return dense_soft_ce_top1(F.linear(hidden, weight), teacher, valid)
    if rows is None:
        assert teacher_logits.shape[0] == hidden.shape[0], (teacher_logits.shape, hidden.shape)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
    assert rows.shape == valid.shape and rows.dtype == torch.int64, (rows.shape, rows.dtype)
    if impl == "triton":
        hidden, weight, teacher_logits = (t.contiguous() for t in (hidden, weight, teacher_logits))
    return _FusedSoftCE.apply(hidden, weight, teacher_logits, rows, valid, impl, chunk)


def draft_soft_ce(hidden: torch.Tensor, weight: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor,
                  *, impl: str = "auto", chunk: int = DEFAULT_CHUNK, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`draft_soft_ce_top1` without the top-1: the per-row soft CE `[T]` (the benchmark's entry point)."""
    return draft_soft_ce_top1(hidden, weight, teacher_logits, valid, impl=impl, chunk=chunk, rows=rows)[0]

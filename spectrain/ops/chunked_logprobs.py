"""The policy's lm_head read in chunks of tokens: per-token logprobs and the draft's teacher, no `[T, V]` logits.

At Qwen3-8B scale (V = 151936) with 250K tokens per rank, float32 logits `[T, V]` are ~150 GB.
`token_logprobs` is an autograd.Function that applies the lm_head to `chunk_tokens` rows at a
time: the forward keeps only each row's log-sum-exp, the backward recomputes each chunk's
logits and turns `g (onehot(target) - softmax)` into the hidden-state and lm_head gradients
(`draft_loss.head_grads`, the loop the draft's chunked loss uses). `teacher_on_draft_vocab`
reads the draft's teacher off the same chunks, without gradient. Memory: one `[chunk, V]`
float32 logits chunk and a same-size temporary at a time (4096 x 151936 x 4 B = 2.3 GiB each).

Dtypes, as the dense path (`lm_head(hidden)` then `grpo.token_logprobs`'s upcast): the matmul
runs in the autocast dtype under autocast (the inputs are cast to it before the Function, so
the backward recomputes the same logits with autocast off, and the casts' own backward hands
the gradients back in the inputs' dtypes), else in the inputs' dtype (bf16 weights under FSDP's
mixed precision); each chunk's logits are upcast to float32 (float64 for float64 inputs) for the
log-softmax, and the results are float32 (float64).
"""
from __future__ import annotations

import torch

from spectrain.ops.draft_loss import chunk_logits, head_grads, loss_dtype, row_chunks

DEFAULT_CHUNK_TOKENS = 4096  # rows per chunk: [4096, 151936] float32 logits are 2.3 GiB


def _matmul_inputs(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`hidden` and `weight` in the dtype the dense lm_head multiplies them in: autocast's where it is on."""
    assert hidden.dim() == 2 and weight.dim() == 2 and weight.shape[1] == hidden.shape[1], (hidden.shape, weight.shape)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = (t if t.dtype == torch.float64 else t.to(dtype) for t in (hidden, weight))  # as autocast
    assert hidden.dtype == weight.dtype, (hidden.dtype, weight.dtype)
    return hidden, weight


def _lse_and_target_logits(hidden, weight, targets, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the log-sum-exp of the logits and the target's logit (target 0 where it is -1)."""
    dtype = loss_dtype(hidden, weight)
    n_rows = hidden.shape[0]
    lse, picked = (hidden.new_empty(n_rows, dtype=dtype) for _ in range(2))
    for rows in row_chunks(n_rows, chunk):
        logits = chunk_logits(hidden[rows], weight, dtype)
        lse[rows] = logits.logsumexp(-1)
        picked[rows] = logits.gather(-1, targets[rows].clamp_min(0)[:, None]).squeeze(-1)
    return lse, picked


def _logprob_dlogits(hidden, weight, targets, grad, lse) -> torch.Tensor:
    """`grad (onehot(target) - softmax(z))` of one chunk, the logits recomputed (in place: one `[chunk, V]`)."""
    dz = chunk_logits(hidden, weight, grad.dtype).sub_(lse[:, None]).exp_().mul_(-grad[:, None])
    return dz.scatter_add_(1, targets.clamp_min(0)[:, None], grad[:, None])


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[t, targets[t]], saving the inputs and a `[T]` log-sum-exp, no logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        with torch.autocast(hidden.device.type, enabled=False):  # the inputs are already in the matmul dtype
            lse, picked = _lse_and_target_logits(hidden, weight, targets, chunk)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return torch.where(targets >= 0, picked - lse, 0.0)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad = torch.where(targets >= 0, grad_out.to(lse.dtype), 0.0)

        def dlogits(rows: slice) -> torch.Tensor:
            return _logprob_dlogits(hidden[rows], weight, targets[rows], grad[rows], lse[rows])

        with torch.autocast(hidden.device.type, enabled=False):  # the forward's logits, whatever the caller's mode
            grad_hidden, grad_weight = head_grads(hidden, weight, ctx.chunk, dlogits)
        return grad_hidden, grad_weight, None, None


def dense_token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[t] | logits[t]) in float32 (float64 for float64), 0 where the target is -1, from whole
    `logits [T, V]`: the reference the chunked path equals, used where logits exist anyway (the SFT warm
    start, a pipeline's last stage)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return logp.gather(-1, targets.clamp_min(0)[:, None]).squeeze(-1).masked_fill(targets < 0, 0.0)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """log p(targets[t]) under the lm_head `weight`, `[T]` float32 (float64 for float64 inputs); 0 where targets is -1.

    Args:
        hidden: the policy's final normed hidden states `[T, H]` (differentiable).
        weight: its lm_head `[V, H]` (differentiable).
        targets: int64 `[T]`, the next token of each row, -1 for none.
        chunk_tokens: rows of logits (or of their gradient) held at once.
    """
    assert targets.shape == hidden.shape[:1] and targets.dtype == torch.int64, (targets.shape, targets.dtype)
    assert chunk_tokens >= 1, chunk_tokens
    hidden, weight = _matmul_inputs(hidden, weight)
    return _TokenLogprobs.apply(hidden, weight, targets, chunk_tokens)


@torch.no_grad()
def teacher_on_draft_vocab(hidden: torch.Tensor, weight: torch.Tensor, t2d: torch.Tensor,
                           chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's teacher, what `ttt_loss` reads of the `[T, V]` logits, without them (no gradient).

    Returns the full-vocabulary log-softmax at the draft vocabulary's target ids `[T, Vd]`
    (float32; float64 for float64 inputs: `ttt_loss`'s softmax over the draft vocabulary is the same
    as over the restricted logits) and the policy's top-1 over the whole vocabulary `[T]` (int64,
    the acceptance proxy's reference). `t2d`: bool `[V]`, the draft vocabulary.
    """
    assert t2d.shape == weight.shape[:1] and t2d.dtype == torch.bool, (t2d.shape, t2d.dtype, weight.shape)
    assert chunk_tokens >= 1, chunk_tokens
    hidden, weight = _matmul_inputs(hidden, weight)
    used = torch.nonzero(t2d).flatten()  # draft id -> target id
    n_rows, dtype = hidden.shape[0], loss_dtype(hidden, weight)
    logprobs = hidden.new_empty(n_rows, used.numel(), dtype=dtype)
    top1 = hidden.new_empty(n_rows, dtype=torch.long)
    with torch.autocast(hidden.device.type, enabled=False):
        for rows in row_chunks(n_rows, chunk_tokens):
            logits = chunk_logits(hidden[rows], weight, dtype)
            top1[rows] = logits.argmax(-1)
            logprobs[rows] = logits.index_select(1, used) - logits.logsumexp(-1, keepdim=True)
    return logprobs, top1

"""GRPO: group-normalised advantages and the token-level clipped policy loss."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spectrain.config.schema import KL_LOSS_TYPES, LOSS_AGG_MODES, LR_SCHEDULERS  # noqa: F401 (re-exported)
from spectrain.ops.chunked_logprobs import dense_token_logprobs as token_logprobs  # noqa: F401 (the dense path)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4,
                     norm_by_std: bool = True) -> torch.Tensor:
    """`A = (r - mean_group) / (std_group + eps)` for rewards laid out group by group.

    `std` is the sample standard deviation (Bessel-corrected, as in TRL's GRPO); a group
    whose samples all got the same reward has advantage 0 and teaches nothing.
    `norm_by_std=False` is Dr. GRPO's `A = r - mean_group` (verl's `norm_adv_by_std_in_grpo=False`).
    """
    assert rewards.dim() == 1 and rewards.numel() % group_size == 0, (
        f"rewards {tuple(rewards.shape)} must be flat and a multiple of group_size={group_size}")
    groups = rewards.view(-1, group_size).to(torch.float64)
    mean = groups.mean(dim=1, keepdim=True)
    if not norm_by_std:
        return (groups - mean).view(-1).to(rewards.dtype)
    std = groups.std(dim=1, keepdim=True, unbiased=True)
    return ((groups - mean) / (std + eps)).view(-1).to(rewards.dtype)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's overlong reward shaping, per completion (<= 0): a completion of `L` tokens past
    `expected = max_new_tokens - buffer_len` loses `min((L - expected) / buffer_len * factor, factor)`.
    `buffer_len=0`: off (all zeros)."""
    lengths = lengths.to(torch.float64)
    if buffer_len <= 0:
        return torch.zeros_like(lengths)
    exceed = (lengths - (max_new_tokens - buffer_len)).clamp_min(0.0)
    return -torch.clamp(exceed / buffer_len * factor, max=factor)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3; verl's `kl_penalty`).

    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(d) - d - 1 with d = ref - logp (non-negative);
    low_var_kl = k3 with d clamped to [-20, 20] and the estimate to [-10, 10], as verl does.
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    delta = ref_logprobs - logprobs
    if estimator == "k3":
        return torch.exp(delta) - delta - 1.0
    if estimator == "low_var_kl":
        delta = delta.clamp(-20.0, 20.0)
        return (torch.exp(delta) - delta - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl estimator {estimator!r} is not one of {list(KL_LOSS_TYPES)}")


def lr_lambda(scheduler: str, warmup_steps: int, total_steps: int):
    """The learning-rate multiplier after `s` finished GRPO steps, as transformers' / verl's schedules with warm-up:
    `s / warmup_steps` during the warm-up, then 1 (constant), a linear decay to 0 at `total_steps` (linear), or a
    half cosine to 0 at `total_steps` (cosine, transformers' `get_cosine_schedule_with_warmup`)."""
    assert scheduler in LR_SCHEDULERS, scheduler

    def f(s: int) -> float:
        if s < warmup_steps:
            return s / max(1, warmup_steps)
        if scheduler == "constant":
            return 1.0
        progress = (s - warmup_steps) / max(1, total_steps - warmup_steps)
        if scheduler == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))

    return f




@dataclass
class GRPOLossOutput:
    loss: torch.Tensor
    clip_fraction: torch.Tensor
    kl: torch.Tensor
    ratio_mean: torch.Tensor


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
    num_tokens: int | float | None = None,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    kl_loss_type: str = "k3",
    loss_agg_mode: str = "token-mean",
    response_lengths: torch.Tensor | None = None,
    num_seqs: int | float | None = None,
) -> GRPOLossOutput:
    """Token-level `-min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)` plus `beta * KL(pi || ref)`.

    All inputs are per token `[T]`; `mask` selects response tokens. `clip_ratio_low` / `clip_ratio_high`
    (DAPO's clip-higher) default to `clip_ratio`. KL is `kl_estimate(..., kl_loss_type)` (default k3,
    the non-negative `exp(d) - d - 1`, `d = ref - logp`).

    `loss_agg_mode` (verl's names) aggregates the per-token loss:
    - token-mean: the sum over response tokens / `num_tokens` (default: the mask's count);
    - seq-mean-token-sum: the mean over sequences of each one's token sum: the sum / `num_seqs`;
    - seq-mean-token-mean: the mean over sequences of each one's token mean: each token weighs
      1 / its document's response length (`response_lengths`), and the sum is divided by `num_seqs`.
    Both normalisers are global so micro-batches, CP shards and ranks add their shares up; `num_seqs`
    defaults to the documents in `response_lengths` (whole documents only). The metrics
    (clip_fraction, kl, ratio_mean) are token means over `num_tokens` in every mode.
    """
    mask = mask.to(logprobs.dtype)
    denom = mask.sum() if num_tokens is None else torch.as_tensor(float(num_tokens), dtype=logprobs.dtype)
    denom = denom.clamp_min(1.0)
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_loss_coef > 0:
        kl = kl_estimate(logprobs, ref_logprobs, kl_loss_type)
        per_token = per_token + kl_loss_coef * kl
    clip_fraction = ((clipped != unclipped).to(mask.dtype) * mask).sum() / denom
    if loss_agg_mode == "token-mean":
        loss = (per_token * mask).sum() / denom
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        assert response_lengths is not None or num_seqs is not None, (
            f"loss_agg_mode={loss_agg_mode} needs num_seqs (or response_lengths to count whole documents)")
        per_doc = (mask / response_lengths.to(logprobs.dtype).clamp_min(1.0)) if response_lengths is not None else None
        if num_seqs is not None:
            seqs = torch.as_tensor(float(num_seqs), dtype=logprobs.dtype)
        else:
            assert per_doc is not None  # response_lengths is given (asserted above)
            seqs = per_doc.sum()
        weights = mask if loss_agg_mode == "seq-mean-token-sum" else per_doc
        assert weights is not None, "loss_agg_mode=seq-mean-token-mean needs response_lengths"
        loss = (per_token * weights).sum() / seqs.clamp_min(1.0)
    else:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
    return GRPOLossOutput(
        loss=loss,
        clip_fraction=clip_fraction.detach(),
        kl=((kl * mask).sum() / denom).detach(),
        ratio_mean=((ratio * mask).sum() / denom).detach(),
    )


def minibatch_documents(num_docs: int, minibatches: int, generator: torch.Generator) -> list[list[int]]:
    """A shuffled split of the rollout's documents into `minibatches` near-equal parts, one per update.

    Every rank passes a generator seeded the same way, so all ranks agree on the split.
    """
    assert 1 <= minibatches <= num_docs, f"cannot split {num_docs} documents into {minibatches} minibatches"
    order = torch.randperm(num_docs, generator=generator) if minibatches > 1 else torch.arange(num_docs)
    return [sorted(part.tolist()) for part in torch.tensor_split(order, minibatches)]

"""GRPO: group-normalised advantages and the token-level clipped policy loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spectrain.ops.chunked_logprobs import dense_token_logprobs as token_logprobs  # noqa: F401 (the dense path)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """`A = (r - mean_group) / (std_group + eps)` for rewards laid out group by group.

    `std` is the sample standard deviation (Bessel-corrected, as in TRL's GRPO); a group
    whose samples all got the same reward has advantage 0 and teaches nothing.
    """
    assert rewards.dim() == 1 and rewards.numel() % group_size == 0, (
        f"rewards {tuple(rewards.shape)} must be flat and a multiple of group_size={group_size}")
    groups = rewards.view(-1, group_size).to(torch.float64)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True, unbiased=True)
    return ((groups - mean) / (std + eps)).view(-1).to(rewards.dtype)




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
    clip_eps: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    num_tokens: int | float | None = None,
) -> GRPOLossOutput:
    """Token-level `-min(rho A, clip(rho, 1-eps, 1+eps) A)` plus `beta * KL(pi || ref)`.

    All inputs are per token `[T]`; `mask` selects response tokens. The sum is divided by
    `num_tokens` (default: the mask's count) so microbatches and ranks can share one global
    normaliser. KL uses the non-negative k3 estimator `exp(d) - d - 1`, `d = ref - logp`.
    """
    mask = mask.to(logprobs.dtype)
    denom = mask.sum() if num_tokens is None else torch.as_tensor(float(num_tokens), dtype=logprobs.dtype)
    denom = denom.clamp_min(1.0)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_beta > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_beta * kl
    clip_fraction = ((clipped != unclipped).to(mask.dtype) * mask).sum() / denom
    return GRPOLossOutput(
        loss=(per_token * mask).sum() / denom,
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

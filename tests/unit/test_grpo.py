"""GRPO advantages and loss against hand-computed values."""
import math

import torch

from spectrain.batch import build_rollout_batch
from spectrain.rollout.engine import Completion
from spectrain.train.grpo import group_advantages, grpo_loss, minibatch_documents, token_logprobs


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4, eps=1e-4)
    std = math.sqrt(((0.5**2) * 4) / 3) + 1e-4  # sample std of [1, 0, 0, 1], plus eps
    expected = torch.tensor([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0, 0, 0, 0])
    assert torch.allclose(adv, expected.float(), atol=1e-6)


def test_grpo_loss_hand_computed():
    logp = torch.log(torch.tensor([0.5, 0.5, 0.9]))
    old = torch.log(torch.tensor([0.25, 0.5, 0.5]))  # ratios 2.0, 1.0, 1.8
    adv = torch.tensor([1.0, -1.0, -2.0])
    mask = torch.tensor([True, True, True])
    out = grpo_loss(logp, old, adv, mask, clip_ratio=0.2)
    # token 1: min(2*1, 1.2*1) = 1.2; token 2: -1; token 3: min(-3.6, -2.4) = -3.6
    assert math.isclose(out.loss.item(), -(1.2 - 1.0 - 3.6) / 3, rel_tol=1e-6)
    assert math.isclose(out.clip_fraction.item(), 2 / 3, rel_tol=1e-6)


def test_grpo_loss_gradient_is_policy_gradient_on_policy():
    logits = torch.randn(5, 7, requires_grad=True)
    targets = torch.tensor([1, 2, 3, 4, 5])
    logp = token_logprobs(logits, targets)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0])
    out = grpo_loss(logp, logp.detach(), adv, torch.ones(5, dtype=torch.bool))
    out.loss.backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    (-(token_logprobs(ref_logits, targets) * adv).sum() / 5).backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)


def test_kl_term_and_mask_and_global_normaliser():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    ref = torch.tensor([-1.5, -2.0, -1.0])
    mask = torch.tensor([True, True, False])
    out = grpo_loss(logp, logp, torch.zeros(3), mask, kl_loss_coef=0.5, ref_logprobs=ref, num_tokens=4)
    kl = [math.exp(-0.5) + 0.5 - 1, 0.0]
    assert math.isclose(out.loss.item(), 0.5 * sum(kl) / 4, rel_tol=1e-6)


def test_rollout_batch_masks_only_response_tokens():
    c = [Completion(0, [1, 10, 11], [20, 21, 2], [-0.1, -0.2, -0.3], True),
         Completion(0, [1, 12], [22], [-0.5], False)]
    b = build_rollout_batch(c, torch.tensor([1.0, -1.0]))
    assert b.cu_seqlens.tolist() == [0, 6, 9]
    assert b.targets.tolist() == [10, 11, 20, 21, 2, -1, 12, 22, -1]
    assert b.response_mask.tolist() == [False, False, True, True, True, False, False, True, False]
    assert torch.allclose(b.rollout_logprobs, torch.tensor([0, 0, -0.1, -0.2, -0.3, 0, 0, -0.5, 0]))
    assert b.advantages.tolist() == [1.0] * 6 + [-1.0] * 3
    sub = b.select([1])
    assert sub.input_ids.tolist() == [1, 12, 22] and sub.cu_seqlens.tolist() == [0, 3]


def test_minibatches_split_every_document_once_and_agree_across_ranks():
    parts = minibatch_documents(10, 3, torch.Generator().manual_seed(5))
    assert [len(p) for p in parts] == [4, 3, 3]
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert parts == minibatch_documents(10, 3, torch.Generator().manual_seed(5))  # same seed, same split
    assert minibatch_documents(4, 1, torch.Generator()) == [[0, 1, 2, 3]]

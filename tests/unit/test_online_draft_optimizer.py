"""The online draft optimizer does no harm: its first update on a converged draft keeps the loss where it was.

A fresh AdamW at the warm-up's rate makes full-size sign steps (its moments start at zero), which
undo the warm-up: that case is kept here as the control, so the test shows the difference.
"""
import random

import pytest
import torch

from spectrain.config import load_config
from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM
from spectrain.parallel.plan import draft_inputs_from, ttt_valid_tokens
from spectrain.tasks.arithmetic import ArithmeticTask
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train.draft_update import draft_loss, draft_optimizer, draft_update
from spectrain.train.online_draft import DraftTraining, OnlineDraft
from spectrain.train.warm_start import examples_to_batch, warm_up_draft

TOLERANCE = 0.02  # the first online update may raise the loss on its own batch by at most 2%
PASSES, DECAY = 3, 0.8


@pytest.fixture(scope="module")
def converged(one_thread):
    torch.manual_seed(0)
    task, tokenizer = ArithmeticTask(2, 2, seed=0), CharTokenizer()
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1))
    with torch.no_grad():
        policy.lm_head.weight.mul_(40)  # a confident teacher, as a trained policy is: the draft has something to learn
    draft = Eagle3Draft(Eagle3Config.from_policy(policy.cfg))
    warmup = draft_optimizer(draft, lr=3e-3)
    warm_up_draft(draft, policy, task, tokenizer, steps=120, batch_size=8, optimizer=warmup, ttt_passes=PASSES,
                  pass_decay=DECAY, seed=0, progress=False)
    batch = examples_to_batch(task.sample(64, random.Random(1)), tokenizer)
    with torch.no_grad():
        out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=draft.cfg.tap_layers)
    chunk = draft_inputs_from(out, batch, policy.attention_ops, None, ttt_valid_tokens(batch))
    return policy, draft, warmup.state_dict(), tokenizer, chunk


def online_cotraining(draft: Eagle3Draft, warmup_state: dict, overrides: list[str]) -> OnlineDraft:
    """`spectrain fit`'s draft owner for these overrides, after the module's `on_fit_start` built its optimizer and
    ramp (the warm-up's state carried as `SpecTrainer` carries it: with draft.carry_warmup_optimizer)."""
    d = load_config(None, overrides).draft
    owner = OnlineDraft(draft, DraftTraining.from_config(d), warmup_state if d.carry_warmup_optimizer else None)
    owner.setup(lambda optimizer: optimizer.state_dict())
    return owner


def loss_after_first_online_update(converged, overrides: list[str]) -> tuple[float, float, float]:
    """(loss before, loss after, lr used) of one online update built exactly as `spectrain fit` builds it."""
    _, draft, warmup_state, _, chunk = converged
    draft = Eagle3Draft(draft.cfg)
    draft.load_state_dict(converged[1].state_dict())
    cotraining = online_cotraining(draft, warmup_state, overrides)
    optimizer, ramp = cotraining.optimizer, cotraining.lr_ramp
    with torch.no_grad():
        before = draft_loss(draft, [chunk], PASSES, DECAY)[0].item()
    lr = optimizer.param_groups[0]["lr"]
    assert draft_update(draft, optimizer, [chunk], ttt_passes=PASSES, pass_decay=DECAY, grad_clip=1.0).applied
    ramp.step()
    with torch.no_grad():
        after = draft_loss(draft, [chunk], PASSES, DECAY)[0].item()
    return before, after, lr


def test_the_default_first_online_update_keeps_the_converged_loss(converged):
    before, after, lr = loss_after_first_online_update(converged, [])
    assert lr == pytest.approx(3e-4 / 11)  # the ramp's first step: lr / (lr_ramp_updates + 1)
    assert after <= before * (1 + TOLERANCE), (before, after)


def test_a_fresh_adamw_at_the_warmup_rate_undoes_the_warmup(converged):
    """The control: what the defaults avoid (and what made the co-trained draft fall behind the frozen one)."""
    old = ["draft.lr=3e-3", "draft.lr_ramp_updates=0", "draft.carry_warmup_optimizer=false"]
    before, after, lr = loss_after_first_online_update(converged, old)
    assert lr == 3e-3
    assert after > before * (1 + TOLERANCE), (before, after)


def test_the_warmup_moments_are_carried_and_the_lr_is_the_online_one(converged):
    _, draft, warmup_state, _, _ = converged
    optimizer = online_cotraining(draft, warmup_state, []).optimizer
    carried = optimizer.state_dict()["state"]
    assert carried.keys() == warmup_state["state"].keys()
    assert all(torch.equal(carried[i]["exp_avg_sq"], warmup_state["state"][i]["exp_avg_sq"]) for i in carried)
    assert {g["initial_lr"] for g in optimizer.param_groups} == {3e-4}

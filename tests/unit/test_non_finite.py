"""A NaN/inf loss or gradient stops at its update: the policy's before its optimizer step, the draft's as a skip."""
import math
from types import SimpleNamespace

import pytest
import torch

from spectrain.config import load_config
from spectrain.errors import NonFiniteError
from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft
from spectrain.parallel.plan import draft_inputs_from, ttt_valid_tokens
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train.draft_update import draft_optimizer, draft_update
from spectrain.train.module import GRPOModule
from tests.helpers import mixed_length_batch, tiny_policy

LENGTHS = [(3, 5), (4, 2), (2, 6)]


def module_and_optimizer():
    """A GRPOModule off any Trainer: its optimizer (in the shape of Lightning's wrapper) and backward handed in."""
    module = GRPOModule(load_config(None, []), tiny_policy(), None, CharTokenizer(), reward_fn=None)
    opt = torch.optim.AdamW(module.policy.parameters(), lr=1e-2)
    module.policy_optimizer = lambda: SimpleNamespace(optimizer=opt, zero_grad=opt.zero_grad, step=opt.step)
    module.manual_backward = lambda loss: loss.backward()
    return module, opt


def weights(module):
    return {name: p.detach().clone() for name, p in module.policy.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[n], b[n], rtol=0, atol=0, equal_nan=True) for n in a)


def inf_advantage(module, batch):
    batch.advantages[batch.response_mask] = float("inf")


def nan_weight(module, batch):
    with torch.no_grad():
        module.policy.model.layers["1"].mlp.up_proj.weight[0, 0] = float("nan")


def test_a_finite_update_steps_the_policy():
    """The control: the same update on a clean batch changes the weights, so the refusals below are the check's."""
    module, opt = module_and_optimizer()
    batch, before = mixed_length_batch(LENGTHS, module.policy.cfg.vocab_size), weights(module)
    module.policy_update(batch, None, 0, 1, 1)
    assert not same(before, weights(module)) and opt.state


@pytest.mark.parametrize("poison", [inf_advantage, nan_weight])
def test_a_non_finite_update_stops_before_the_optimizer_step(poison):
    module, opt = module_and_optimizer()
    batch = mixed_length_batch(LENGTHS, module.policy.cfg.vocab_size)
    poison(module, batch)
    before = weights(module)
    with pytest.raises(NonFiniteError, match=r"^policy update 2 of 3 in step 1: the loss \(-?(nan|inf)\) or the "
                                             r"gradient norm \((nan|inf)\) is not finite\. Stopped before the "
                                             r"optimizer step: no weight was changed by it.*lower grpo\.lr"):
        module.policy_update(batch, None, 1, 3, 1)
    assert same(before, weights(module)) and not opt.state  # AdamW never stepped: no moments either


def test_the_check_reads_every_rank_s_shared_values():
    """The plans hand back the summed loss and the reduced norm; either one non-finite is enough to stop."""
    module, _ = module_and_optimizer()
    module.check_finite_update(1.5, 0.3, 0, 4, 1)
    for loss, norm in ((math.inf, 0.3), (1.5, math.nan)):
        with pytest.raises(NonFiniteError, match=r"policy update 1 of 4"):
            module.check_finite_update(loss, norm, 0, 4, 1)


def test_a_draft_update_with_an_infinite_gradient_is_skipped_with_its_norm():
    torch.manual_seed(0)
    policy = tiny_policy()
    draft = Eagle3Draft(Eagle3Config.from_policy(policy.cfg))
    batch = mixed_length_batch(LENGTHS, policy.cfg.vocab_size)
    with torch.no_grad():
        out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=draft.cfg.tap_layers)
    chunk = draft_inputs_from(out, batch, policy.attention_ops, None, ttt_valid_tokens(batch))
    opt, before = draft_optimizer(draft, 1e-3), {n: p.detach().clone() for n, p in draft.named_parameters()}

    def overflowing_backward(loss):  # the fault: one gradient entry overflows, the loss itself is finite
        loss.backward()
        draft.fc.weight.grad[0, 0] = float("inf")

    update = draft_update(draft, opt, [chunk], ttt_passes=2, pass_decay=0.8, grad_clip=1.0,
                          backward=overflowing_backward)
    assert not update.applied and math.isfinite(update.loss) and update.grad_norm == math.inf
    assert all(torch.equal(before[n], p) for n, p in draft.named_parameters()) and not opt.state


def test_a_diverging_warm_start_sft_stops_with_its_step():
    from spectrain.tasks.arithmetic import ArithmeticTask
    from spectrain.train.warm_start import train_sft

    policy = tiny_policy()
    with torch.no_grad():
        policy.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"warm-start SFT step 1 of 5: the loss \(nan\).*nothing was cached"):
        train_sft(policy, ArithmeticTask(), CharTokenizer(), steps=5, batch_size=4, lr=1e-3, seed=0, progress=False)

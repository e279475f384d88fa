"""The verl-named GRPO options (docs/your_model.md, "GRPO loss options") against hand-computed values on tiny
float64 batches, their wiring into `GRPOModule`, and the ConfigErrors for bad values."""
import math
from types import SimpleNamespace

import pytest
import torch

from spectrain.batch import build_rollout_batch, document_response_lengths
from spectrain.config import ConfigError, load_config
from spectrain.parallel.cp.plan import shard_batch
from spectrain.parallel.cp.zigzag import ZigzagLayout, shard
from spectrain.rollout.engine import Completion, LoadStats, SpecDecodeCounters
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train.grpo import group_advantages, grpo_loss, kl_estimate, lr_lambda, overlong_penalty
from spectrain.train.module import GRPOModule
from spectrain.train.step import RolloutStats
from tests.helpers import mixed_length_batch, tiny_policy

F64 = torch.float64


def two_doc_batch():
    """doc 0: prompt [1, 10], response [20, 21] (A = 1); doc 1: prompt [1, 12], response [22, 23, 24] (A = -2).
    The policy's ratios to the engine are 1.1, 0.9 (doc 0) and 1.0, 1.1, 0.95 (doc 1): all inside the clip range,
    so each token's loss is -ratio * A: doc 0 -1.1, -0.9 (sum -2, mean -1); doc 1 2.0, 2.2, 1.9 (sum 6.1)."""
    completions = [Completion(0, [1, 10], [20, 21], [-0.5, -1.0], True),
                   Completion(0, [1, 12], [22, 23, 24], [-0.3, -0.7, -1.2], True)]
    batch = build_rollout_batch(completions, torch.tensor([1.0, -2.0]))
    ratios = torch.ones(batch.input_ids.numel(), dtype=F64)
    ratios[batch.response_mask] = torch.tensor([1.1, 0.9, 1.0, 1.1, 0.95], dtype=F64)
    logprobs = batch.rollout_logprobs.double() + ratios.log()
    return batch, logprobs


def loss(batch, logprobs, mode, **kw):
    return grpo_loss(logprobs, batch.rollout_logprobs.double(), batch.advantages.double(), batch.response_mask,
                     0.2, loss_agg_mode=mode, response_lengths=batch.response_lengths, **kw).loss.item()


HAND = {
    "token-mean": (-2.0 + 6.1) / 5,  # all five response tokens
    "seq-mean-token-sum": (-2.0 + 6.1) / 2,  # each document's sum, averaged over the two
    "seq-mean-token-mean": (-2.0 / 2 + 6.1 / 3) / 2,  # each document's mean, averaged over the two
}


def test_response_lengths_are_each_document_s_response_count():
    batch, _ = two_doc_batch()
    assert batch.response_lengths.tolist() == [2.0] * 4 + [3.0] * 5
    assert batch.select([1]).response_lengths.tolist() == [3.0] * 5
    cu, mask = torch.tensor([0, 3, 3, 5]), torch.tensor([False, True, True, True, False])
    assert document_response_lengths(cu, mask).tolist() == [2.0, 2.0, 2.0, 1.0, 1.0]  # an empty document between


@pytest.mark.parametrize("mode", list(HAND))
def test_loss_agg_modes_hand_computed(mode):
    batch, logprobs = two_doc_batch()
    assert math.isclose(loss(batch, logprobs, mode), HAND[mode], rel_tol=1e-12)


def test_token_mean_is_today_s_loss_exactly():
    batch, logprobs = two_doc_batch()
    args = (logprobs, batch.rollout_logprobs.double(), batch.advantages.double(), batch.response_mask, 0.2)
    default, explicit = grpo_loss(*args, num_tokens=7), grpo_loss(*args, num_tokens=7, loss_agg_mode="token-mean")
    assert default.loss.item() == explicit.loss.item() == pytest.approx((-2.0 + 6.1) / 7, rel=1e-12)


@pytest.mark.parametrize("mode", list(HAND))
def test_seq_modes_add_up_over_documents_and_cp_shards(mode):
    """The plans compute the loss per micro-batch and per CP shard with the update's global normalisers and sum the
    shares: the seq modes must come out the same as on the whole batch."""
    batch, logprobs = two_doc_batch()
    glob = dict(num_tokens=batch.num_response_tokens, num_seqs=batch.num_docs)
    per_doc = sum(loss(batch.select([i]), logprobs[int(batch.cu_seqlens[i]):int(batch.cu_seqlens[i + 1])],
                       mode, **glob) for i in range(2))
    assert math.isclose(per_doc, HAND[mode], rel_tol=1e-12)
    for cp in (2, 3):
        shares = []
        for rank in range(cp):
            layout = ZigzagLayout.build(batch.cu_seqlens, cp, rank, max_seqlen=64)
            local = shard_batch(batch, layout, pad_id=0)
            shares.append(loss(local, shard(logprobs, layout, 0.0), mode, **glob))
        assert math.isclose(sum(shares), HAND[mode], rel_tol=1e-12), (cp, shares)


def test_clip_higher_hand_computed():
    # ratios 1.5, 0.5, 1.25; A = 1, -1, 1; clipped to [1 - 0.2, 1 + 0.28]
    logp = torch.log(torch.tensor([1.5, 0.5, 1.25], dtype=F64))
    old, adv, mask = torch.zeros(3, dtype=F64), torch.tensor([1.0, -1.0, 1.0], dtype=F64), torch.ones(3, dtype=bool)
    out = grpo_loss(logp, old, adv, mask, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # token 1: min(1.5, 1.28) = 1.28; token 2: min(-0.5, -0.8) = -0.8; token 3: min(1.25, 1.25) (unclipped)
    assert math.isclose(out.loss.item(), -(1.28 - 0.8 + 1.25) / 3, rel_tol=1e-12)
    assert math.isclose(out.clip_fraction.item(), 2 / 3, rel_tol=1e-12)
    # only the upper bound moves: clip_ratio_low=None keeps clip_ratio (0.1) below, so token 2 is min(-0.5, -0.9)
    out = grpo_loss(logp, old, adv, mask, clip_ratio=0.1, clip_ratio_high=0.28)
    assert math.isclose(out.loss.item(), -(1.28 - 0.9 + 1.25) / 3, rel_tol=1e-12)
    symmetric = grpo_loss(logp, old, adv, mask, clip_ratio=0.2)  # today's: token 3 clips at 1.2
    assert math.isclose(symmetric.loss.item(), -(1.2 - 0.8 + 1.2) / 3, rel_tol=1e-12)


def test_dr_grpo_advantages_skip_the_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0], dtype=F64)
    assert group_advantages(rewards, 4, norm_by_std=False).tolist() == [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]
    std = math.sqrt(2 / 3)  # sample std of [3, 1, 2, 2]
    with_std = group_advantages(rewards, 4, eps=1e-4)
    assert with_std[4].item() == pytest.approx(1.0 / (std + 1e-4), rel=1e-12)


def test_kl_estimators_hand_computed():
    logp = torch.tensor([-1.0, -2.0, -30.0], dtype=F64)
    ref = torch.tensor([-1.5, -0.5, -5.0], dtype=F64)  # d = ref - logp = -0.5, 1.5, 25
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.5, -25.0], rel=1e-12)
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 1.125, 312.5], rel=1e-12)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.5) - 2.5, math.exp(25) - 26]
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(k3, rel=1e-12)
    assert kl_estimate(logp, ref, "low_var_kl").tolist() == pytest.approx([k3[0], k3[1], 10.0], rel=1e-12)
    # in the loss: A = 0, so it is beta x the token mean of the estimate
    mask = torch.tensor([True, True, False])
    for name, want in (("k1", (0.5 - 1.5) / 2), ("k2", (0.125 + 1.125) / 2), ("k3", (k3[0] + k3[1]) / 2)):
        out = grpo_loss(logp, logp, torch.zeros(3, dtype=F64), mask, ref_logprobs=ref, kl_loss_coef=0.5,
                        kl_loss_type=name)
        assert math.isclose(out.loss.item(), 0.5 * want, rel_tol=1e-12), name
        assert math.isclose(out.kl.item(), want, rel_tol=1e-12), name


def test_overlong_penalty_hand_computed():
    # max 10, buffer 4: expected length 6; factor 0.5
    lengths = torch.tensor([3, 6, 7, 8, 10])
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, 10, 0, 0.5).tolist() == [0.0] * 5  # off


@pytest.mark.parametrize("name, warmup, want", [
    ("constant", 0, [1, 1, 1, 1, 1, 1, 1]),
    ("constant", 2, [0, 0.5, 1, 1, 1, 1, 1]),
    ("linear", 2, [0, 0.5, 1, 0.75, 0.5, 0.25, 0]),
    ("linear", 0, [1, 5 / 6, 4 / 6, 0.5, 2 / 6, 1 / 6, 0]),
    ("cosine", 2, [0, 0.5, 1, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0]),
])
def test_lr_schedules_hand_computed(name, warmup, want):
    f = lr_lambda(name, warmup, total_steps=6)
    assert [f(s) for s in range(7)] == pytest.approx(want, abs=1e-12)


# the module -----------------------------------------------------------------------------------------------------

def bare_module(overrides):
    """A GRPOModule off any Trainer (as tests/unit/test_non_finite.py builds it), with its real optimizers."""
    module = GRPOModule(load_config(None, overrides), tiny_policy(), None, CharTokenizer(), reward_fn=None)
    configured = module.configure_optimizers()
    opts, scheds = configured if isinstance(configured, tuple) else ([configured], [])
    opt = opts[0]
    module.policy_optimizer = lambda: SimpleNamespace(optimizer=opt, zero_grad=opt.zero_grad, step=opt.step)
    module.lr_schedulers = lambda: (None if not scheds else scheds[0] if len(scheds) == 1 else scheds)
    module.manual_backward = lambda loss: loss.backward()
    return module, opt, scheds


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("micro_batch_tokens", [None, 1])
def test_policy_update_aggregates_over_the_whole_part(mode, micro_batch_tokens, one_thread):
    """`policy_update` hands the update's global sequence count to every micro-batch's loss: its loss is the
    hand-aggregated one of the whole part, micro-batched or not."""
    module, _, _ = bare_module([f"grpo.loss_agg_mode={mode}",
                                f"grpo.micro_batch_tokens={micro_batch_tokens or 'null'}"])
    batch = mixed_length_batch([(3, 5), (4, 2), (2, 6)], module.policy.cfg.vocab_size)
    result, _ = module.policy_update(batch, None, 0, 1, 1)
    lp = result.logprobs.detach().double()  # the policy before the step; on-policy ratios are exp(lp - engine)
    ratio = torch.exp(lp - batch.rollout_logprobs.double())
    adv = batch.advantages.double()
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    docs = []
    for i in range(batch.num_docs):
        lo, hi = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        tokens = per_token[lo:hi][batch.response_mask[lo:hi]]
        docs.append(tokens.sum() if mode == "seq-mean-token-sum" else tokens.mean())
    torch.testing.assert_close(result.loss.double(), torch.stack(docs).mean(), rtol=1e-5, atol=1e-6)


def with_rollout(module, lengths, rewards):
    """`module` off any Trainer, its rollout the given completions (two per prompt) and rewards; what it logs."""
    completions = [Completion(i // 2, [1, 5], [7] * n, [-0.5] * n, True) for i, n in enumerate(lengths)]
    stats = RolloutStats(1.0, len(lengths), sum(lengths), SpecDecodeCounters(), LoadStats())
    module.generate = lambda examples, n, purpose, greedy=False, step=None: (completions, stats)
    module.score = lambda examples, completions, where: rewards
    module.trainer = SimpleNamespace(global_step=0, callbacks=[],
                                     strategy=SimpleNamespace(reduce=lambda t, reduce_op: t))
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    module.log_dict = lambda values, **kw: logged.update({k: float(v) for k, v in values.items()})
    return logged


def test_training_step_shapes_rewards_normalises_and_steps_the_schedule(one_thread):
    """Overlong penalty before Dr. GRPO advantages; `policy/lr` logged; the schedule stepped once per GRPO step."""
    module, opt, scheds = bare_module(["grpo.overlong_buffer_len=4", "grpo.overlong_penalty_factor=0.5",
                                       "grpo.norm_adv_by_std_in_grpo=false", "rollout.response_length=10",
                                       "rollout.n=2", "grpo.lr=0.1", "grpo.lr_scheduler=linear",
                                       "grpo.lr_warmup_steps=1", "trainer.max_steps=3"])
    assert len(scheds) == 1 and opt.param_groups[0]["lr"] == 0.0  # warm-up from 0
    # two prompts x two samples: lengths 3, 8 (penalty -0.25) and 10 (-0.5), 6 (0)
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    logged = with_rollout(module, [3, 8, 10, 6], rewards)
    lrs = []
    for _ in range(3):
        out = module.training_step([None, None], 0)
        lrs.append(logged["policy/lr"])
    assert lrs == pytest.approx([0.0, 0.1, 0.05])  # lr x [0, 1, 1 - 1/2]: warm-up 1, then linear to 0 at step 3
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0) and scheds[0].last_epoch == 3
    assert logged["reward/overlong_penalty"] == pytest.approx((-0.25 - 0.5) / 4)
    # shaped rewards 1, 0.75 | -0.5, 1: r - mean, no std
    step = out["step"]
    per_doc = [float(step.batch.advantages[int(step.batch.cu_seqlens[i])]) for i in range(4)]
    assert per_doc == pytest.approx([0.125, -0.125, -0.75, 0.75])
    assert step.rewards.tolist() == rewards.tolist()  # what is logged as `reward`: the task's, unshaped


def test_dynamic_sampling_drops_the_groups_of_equal_rewards(one_thread):
    module, _, _ = bare_module(["grpo.dynamic_sampling=true", "rollout.n=2", "grpo.minibatches=4"])
    logged = with_rollout(module, [3, 4, 5, 6], torch.tensor([1.0, 1.0, 0.0, 1.0]))  # group 0: all equal
    step = module.training_step([None, None], 0)["step"]
    assert logged["rollout/groups_dropped"] == 1.0 and step.batch.num_docs == 2
    assert step.batch.response_lengths.unique().tolist() == [5.0, 6.0]  # group 1's two documents
    assert step.policy.updates == 2  # grpo.minibatches=4 capped at the two documents left
    logged = with_rollout(module, [3, 4, 5, 6], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    with pytest.warns(UserWarning, match="every group of the step-1 rollout got equal rewards"):
        step = module.training_step([None, None], 0)["step"]
    assert logged["rollout/groups_dropped"] == 2.0 and step.batch.num_docs == 4  # all kept (zero advantage)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_constant_lr_adds_no_scheduler_and_a_schedule_resumes():
    module = GRPOModule(load_config(None, []), tiny_policy(), None, CharTokenizer(), reward_fn=None)
    assert isinstance(module.configure_optimizers(), torch.optim.AdamW)  # a constant lr: no scheduler
    _, _, scheds = bare_module(["grpo.lr_scheduler=cosine", "grpo.lr_warmup_steps=2", "trainer.max_steps=10"])
    for _ in range(5):
        scheds[0].step()
    _, opt, fresh = bare_module(["grpo.lr_scheduler=cosine", "grpo.lr_warmup_steps=2", "trainer.max_steps=10"])
    fresh[0].load_state_dict(scheds[0].state_dict())
    fresh[0].step()
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-5 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))


# validation -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, match", [
    ("grpo.loss_agg_mode=seq-mean", r"grpo.loss_agg_mode: 'seq-mean' is not one of \['token-mean', "
                                    r"'seq-mean-token-sum', 'seq-mean-token-mean'\]"),
    ("grpo.kl_loss_type=k4", r"grpo.kl_loss_type: 'k4' is not one of \['k1', 'k2', 'k3', 'low_var_kl'\]"),
    ("grpo.lr_scheduler=step", r"grpo.lr_scheduler: 'step' is not one of \['constant', 'linear', 'cosine'\]"),
    ("grpo.clip_ratio_high=0", r"grpo.clip_ratio_high: is 0.0; it must be > 0 .*or null for grpo.clip_ratio"),
    ("grpo.clip_ratio_low=-0.1", r"grpo.clip_ratio_low: is -0.1; it must be > 0"),
    ("grpo.clip_ratio_low=1.0", r"grpo.clip_ratio_low: is 1.0; it must be < 1"),
    ("grpo.overlong_buffer_len=25", r"grpo.overlong_buffer_len: is 25; it must be in \[0, rollout.response_length=24\]"
                                    r".*or 0 to turn the overlong penalty off"),
    ("grpo.overlong_buffer_len=-1", r"grpo.overlong_buffer_len: is -1"),
    ("grpo.overlong_penalty_factor=-1", r"grpo.overlong_penalty_factor: is -1.0; it must be >= 0"),
    ("grpo.dynamic_sampling=true parallel.dp=2",
     r"grpo.dynamic_sampling: drops documents per step, but parallel.dp=2 .*parallel.dp=1 and parallel.pp=1"),
    ("grpo.lr_warmup_steps=-2", r"grpo.lr_warmup_steps: is -2; give a number of GRPO steps >= 0"),
])
def test_bad_values_are_refused_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, override.split())


def test_the_options_load():
    c = load_config(None, ["grpo.loss_agg_mode=seq-mean-token-mean", "grpo.clip_ratio_high=0.28",
                           "grpo.norm_adv_by_std_in_grpo=false", "grpo.kl_loss_type=low_var_kl",
                           "grpo.overlong_buffer_len=4",
                           "grpo.lr_scheduler=cosine", "grpo.lr_warmup_steps=2"])
    assert c.grpo.clip_ratio_low is None and c.grpo.clip_ratio_high == 0.28 and c.grpo.norm_adv_by_std_in_grpo is False


def test_with_a_draft_the_module_configures_only_the_policy_and_refuses_a_checkpoint_without_draft_state():
    """The draft's optimizer and lr ramp are its owner's (`OnlineDraft`, checkpointed under "draft"); a checkpoint
    without that state (an older layout) is refused in one line."""
    from spectrain.errors import SpecTrainError
    from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft

    policy = tiny_policy()
    module = GRPOModule(load_config(None, ["grpo.lr_scheduler=cosine", "trainer.max_steps=4"]), policy,
                        Eagle3Draft(Eagle3Config.from_policy(policy.cfg)), CharTokenizer(), reward_fn=None)
    [policy_opt], [schedule] = module.configure_optimizers()
    assert [p for g in policy_opt.param_groups for p in g["params"]] == list(policy.parameters())
    assert schedule.optimizer is policy_opt
    saved = {}
    module.on_save_checkpoint(saved)
    assert saved["draft"]["version"] == 0 and "optimizer" not in saved["draft"]  # no optimizer before fit start
    module.on_load_checkpoint(saved)
    with pytest.raises(SpecTrainError, match="the checkpoint holds no draft state"):
        module.on_load_checkpoint({"optimizer_states": [policy_opt.state_dict()]})


# the seq-mean modes through the real dp x cp plan (gloo processes) ------------------------------------------------

CP_POLICY = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)


def _seq_mean_step(plan, reduce_gradients, micro_batch_tokens, mode):
    from tests.helpers import StandInModule

    models = StandInModule(CP_POLICY, (1, 2, 3), seed=0)
    batch = mixed_length_batch([(4, 9), (6, 1), (3, 22), (5, 12), (2, 2), (7, 17)], CP_POLICY["vocab_size"])
    if reduce_gradients:
        plan.prepare(models)

    def loss_fn(logprobs, local):
        out = grpo_loss(logprobs, local.rollout_logprobs.double(), local.advantages.double(), local.response_mask,
                        0.2, num_tokens=batch.num_response_tokens, loss_agg_mode=mode,
                        response_lengths=local.response_lengths, num_seqs=batch.num_docs)
        return out.loss, logprobs

    result = plan.policy_forward_backward(models.policy, batch, loss_fn, (), lambda loss: loss.backward(), None,
                                          micro_batch_tokens)
    plan.reduce_gradients(models.policy)
    return result.loss.detach(), {n: p.grad for n, p in models.policy.named_parameters()}


def _seq_mean_worker(rank, world, dp, cp, micro_batch_tokens, mode):
    from spectrain.parallel.cp.plan import ContextParallelPlan
    from spectrain.parallel.mesh import build_mesh

    return _seq_mean_step(ContextParallelPlan(build_mesh(1, dp, cp)), True, micro_batch_tokens, mode)


@pytest.mark.slow
@pytest.mark.parametrize("dp,cp,micro_batch_tokens", [(1, 2, 1), (2, 1, 20)])
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_seq_modes_under_dp_and_cp_match_one_process(dp, cp, micro_batch_tokens, mode):
    from spectrain.parallel.plan import LocalPlan
    from spectrain.parallel.spawn import run_distributed

    want_loss, want_grads = _seq_mean_step(LocalPlan(), False, None, mode)
    for rank, (loss_, grads) in enumerate(run_distributed(_seq_mean_worker, dp * cp, dp, cp, micro_batch_tokens,
                                                          mode, timeout=240)):
        torch.testing.assert_close(loss_, want_loss, rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank}: {m}")
        for name in want_grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"rank {rank} {name}: {m}")

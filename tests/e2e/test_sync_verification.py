"""Verified syncs on a real vLLM engine: the weight probe, `WeightSync`'s checks, speculation fallback, load stats.

Faults are injected where a user's setup would break: a sync that does nothing, sends scaled
weights, only some tensors, or names vLLM ignores; a drafter that is not the synced draft.
"""
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from spectrain.callbacks import SpeculationDeadError, WeightSync
from spectrain.errors import SyncMismatchError
from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft, draft_sync_weights, export_draft
from spectrain.models.hf_io import save_pretrained
from spectrain.parallel.plan import LocalPlan
from spectrain.rollout.engine import SamplingConfig, SpecDecodeCounters
from spectrain.rollout.engine_layout import EngineLayout
from spectrain.rollout.vllm.engine import VLLMRolloutEngine
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train.online_draft import OnlineDraft
from tests.helpers import StepModuleStandIn as Module
from tests.helpers import sync_step, tiny_policy

pytestmark = pytest.mark.slow
RTOL = 1e-4  # float32 engine vs float32 trainer: observed 3e-7
KV_BLOCKS = 6  # x 32 tokens: room for about 3 sequences of 60 tokens, so a batch of 8 must preempt


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    policy = tiny_policy()
    torch.manual_seed(1)
    draft = Eagle3Draft(Eagle3Config.from_policy(policy.cfg))
    save_pretrained(policy, root / "policy", tokenizer=CharTokenizer())
    export_draft(draft, root / "draft", policy.cfg)
    engine = VLLMRolloutEngine(root / "policy", root / "draft", num_speculative_tokens=3, max_model_len=128,
                               vllm_kwargs={"num_gpu_blocks_override": KV_BLOCKS, "block_size": 32})
    yield SimpleNamespace(engine=engine, policy=policy, draft=draft)
    engine.shutdown()


def policy_weights(policy, scale=1.0, only=None):
    return [(n, t.detach() * (scale if only is None or only in n else 1.0)) for n, t in policy.state_dict().items()]


def test_probe_accepts_the_synced_weights_and_names_every_fault(world):
    engine, policy, draft = world.engine, world.policy, world.draft
    assert engine.verify_weights(policy_weights(policy), "policy", RTOL).ok
    assert engine.verify_weights(draft_sync_weights(draft), "draft", RTOL).ok

    scaled = policy_weights(policy, 1.02)  # what a no-op sync leaves: the engine keeps the old weights
    result = engine.verify_weights(scaled, "policy", RTOL)
    assert not result.ok and result.worst == pytest.approx(0.02 / 1.02, rel=1e-2)
    assert any("qkv_proj" in m for m in result.mismatches) and any("lm_head" in m for m in result.mismatches)

    engine.sync_policy([(n, t) for n, t in policy_weights(policy, 1.02, only="self_attn")
                        if "self_attn" in n], version=1)  # only the attention tensors arrive
    result = engine.verify_weights(policy_weights(policy, 1.02), "policy", RTOL)
    assert result.mismatches and all("self_attn" not in m for m in result.mismatches)
    assert any("mlp.gate_up_proj" in m for m in result.mismatches)
    engine.sync_policy(policy_weights(policy), version=2)
    assert engine.verify_weights(policy_weights(policy), "policy", RTOL).ok

    renamed = [(n.replace("up_proj", "upproj"), t) for n, t in policy_weights(policy)]
    result = engine.verify_weights(renamed, "policy", RTOL)
    assert any("not sent" in m for m in result.mismatches)  # the fused gate_up lost its up half
    assert any("vLLM ignored it" in m and "upproj" in m for m in result.mismatches)

    halved = [(n, t * 0.5) for n, t in draft_sync_weights(draft)]
    engine.sync_draft(halved, version=1)
    result = engine.verify_weights(draft_sync_weights(draft), "draft", RTOL)
    assert any("model.fc" in m for m in result.mismatches) and any("midlayer" not in m for m in result.mismatches)
    engine.sync_draft(draft_sync_weights(draft), version=2)
    assert engine.verify_weights(draft_sync_weights(draft), "draft", RTOL).ok


class FaultyEngine:
    """The real engine, with a sync that does not do what it is told (scales, or drops, the weights)."""

    def __init__(self, engine, policy_scale=1.0, draft_scale=1.0) -> None:
        self.engine, self.policy_scale, self.draft_scale = engine, policy_scale, draft_scale

    def sync_policy(self, weights, version):
        self.engine.sync_policy([(n, t * self.policy_scale) for n, t in weights], version)

    def sync_draft(self, weights, version):
        self.engine.sync_draft([(n, t * self.draft_scale) for n, t in weights], version)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def module_for(engine, world, trains_draft=True):
    return Module(engine=engine, engines=EngineLayout.single(), plan=LocalPlan(), policy=world.policy,
                  draft=OnlineDraft(world.draft), trains_draft=trains_draft,
                  logged={}, rollout_stats=None, engine_logprob_diff=math.nan,
                  policy_weights_for_sync=lambda: policy_weights(world.policy),
                  draft_weights_for_sync=lambda: draft_sync_weights(world.draft))


def start(callback: WeightSync, module, step: int) -> None:
    """`on_train_start` of a run at `step` (a resumed one when > 0): the first sync."""
    module.global_step = step
    callback.on_train_start(None, module)


def test_weight_sync_raises_on_a_bad_sync_and_warn_mode_resends(world):
    module = module_for(FaultyEngine(world.engine, policy_scale=1.02), world)
    with pytest.raises(SyncMismatchError, match="policy sync version 0: the engine does not serve"):
        start(WeightSync(), module, 0)

    callback = WeightSync(on_mismatch="warn")
    with pytest.warns(UserWarning, match="re-sending"):
        start(callback, module, 0)
    assert callback.mismatches == 2  # the sync and its re-send both failed: counted, logged, the run goes on

    module = module_for(FaultyEngine(world.engine, draft_scale=0.5), world)
    with pytest.raises(SyncMismatchError, match="draft sync version 0"):
        start(WeightSync(), module, 3)
    module.engine = world.engine
    start(WeightSync(), module, 4)  # healthy again: no error


def test_rollout_logprobs_are_checked_against_the_tolerance(world):
    module = module_for(world.engine, world)
    callback = WeightSync(check_alive=False)
    start(callback, module, 0)
    module.engine_logprob_diff = 2e-7  # what a float32 engine serving the trainer's weights shows
    sync_step(callback, module, 1)
    module.engine_logprob_diff = 3e-2  # what stale weights showed
    with pytest.raises(SyncMismatchError, match="policy sync version 1: the step-2 rollout's logprobs differ"):
        sync_step(callback, module, 2)
    lenient = WeightSync(check_alive=False, logprob_tolerance=0.1)
    sync_step(lenient, module, 2)
    assert lenient.mismatches == 0


def rollout_stats(drafts, accepted):
    return SimpleNamespace(spec=SpecDecodeCounters(drafts, 3 * drafts, accepted, [accepted, 0, 0]))


def test_without_speculation_decodes_plainly_inside_the_block_and_speculates_again_after(world):
    from spectrain.rollout.vllm import compat

    engine, tokens = world.engine, [CharTokenizer().encode("12+34="), CharTokenizer().encode("7+8=")]
    scheduler = engine.in_process_scheduler()
    schedule = compat.dynamic_k_lookup(scheduler)
    greedy = SamplingConfig(n=1, max_tokens=8, temperature=0.0)

    def drafts() -> int:
        before = engine.spec_decode_counters()
        engine.generate(tokens, greedy)
        return (engine.spec_decode_counters() - before).num_drafts

    with engine.without_speculation():
        assert drafts() == 0
    assert compat.dynamic_k_lookup(scheduler) == schedule and drafts() > 0
    with pytest.raises(RuntimeError, match="inside"), engine.without_speculation():
        raise RuntimeError("inside")
    assert compat.dynamic_k_lookup(scheduler) == schedule  # restored when the block fails too


def test_acceptance_collapse_probes_the_drafter_and_disables_speculation(world):
    engine, tokens = world.engine, [CharTokenizer().encode("12+34="), CharTokenizer().encode("7+8=")]
    module = module_for(engine, world, trains_draft=False)
    for on_dead in ("raise", "disable"):
        callback = WeightSync(on_dead=on_dead)
        start(callback, module, 0)
        for step in (1, 2, 3):  # a healthy window: acceptance length 3.0
            module.rollout_stats = rollout_stats(drafts=50, accepted=100)
            sync_step(callback, module, step)
        # Collapse to 1.2 (gain 0.2 < 0.5 x 2.0) with a drafter that is not the synced draft: dead.
        engine.sync_draft([(n, t * 0.5) for n, t in draft_sync_weights(world.draft)], version=99)
        module.rollout_stats = rollout_stats(drafts=50, accepted=10)
        if on_dead == "raise":
            with pytest.raises(SpeculationDeadError, match="acceptance length fell to 1.20 .*recent median 3.00"):
                sync_step(callback, module, 4)
            continue
        with pytest.warns(UserWarning, match="speculation is OFF from step 5"):
            sync_step(callback, module, 4)
        before = engine.spec_decode_counters()
        engine.generate(tokens, SamplingConfig(n=1, max_tokens=8, temperature=0.0))
        assert (engine.spec_decode_counters() - before).num_drafts == 0  # plain decoding now
        assert callback.state_dict()["speculation_disabled"]


def test_a_collapse_with_the_right_drafter_only_warns(world):
    module = module_for(world.engine, world, trains_draft=False)
    callback = WeightSync()
    start(callback, module, 5)
    module.draft.acceptance = [2.0, 2.0, 2.0]  # the draft's history: acceptance length 3.0
    module.rollout_stats = rollout_stats(drafts=50, accepted=10)
    with pytest.warns(UserWarning,
                      match="fell to 1.20 .*the engine serves the synced draft .*predicts the policy worse"):
        sync_step(callback, module, 6)


def test_the_drafter_is_probed_against_the_last_sync_not_the_draft_trained_since(world):
    """Co-training updates the trainer's draft before the check runs: the engine still holds the synced version."""
    draft = Eagle3Draft(Eagle3Config.from_policy(world.policy.cfg))
    module = module_for(world.engine, SimpleNamespace(policy=world.policy, draft=draft))
    callback = WeightSync()
    start(callback, module, 0)  # version 0 synced and verified
    with torch.no_grad():  # one draft optimizer step later
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))
    module.rollout_stats = rollout_stats(drafts=586, accepted=0)  # a cold draft: it accepted nothing
    with pytest.warns(UserWarning, match=r"step 1: acceptance length is 1\.00 over 586 drafts, and the engine serves "
                                         r"the synced draft \(version 0\): the draft does not predict this policy.*"
                                         r"Co-training learns it"):
        sync_step(callback, module, 1)
    assert not callback.speculation_disabled
    module.rollout_stats = rollout_stats(drafts=586, accepted=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next cold rollouts are quiet
        sync_step(callback, module, 2)
    assert callback.state_dict()["warned"] == ["cold"]


def test_a_frozen_draft_that_does_not_fit_is_warned_about_or_turned_off(world):
    module = module_for(world.engine, world, trains_draft=False)
    module.rollout_stats = rollout_stats(drafts=586, accepted=0)
    warn_only = WeightSync(frozen_draft=True)
    start(warn_only, module, 0)
    with pytest.warns(UserWarning, match="draft.mode=frozen never trains it.*the draft does not fit this policy.*"
                                         "sync.on_dead=disable turns speculation off"):
        sync_step(warn_only, module, 1)
    assert not warn_only.speculation_disabled
    disable = WeightSync(frozen_draft=True, on_dead="disable")
    start(disable, module, 0)
    with pytest.warns(UserWarning, match="speculation is OFF from step 2"):
        sync_step(disable, module, 1)
    assert disable.speculation_disabled and disable.state_dict()["speculation_disabled"]


def test_load_stats_count_preemptions_when_the_kv_cache_is_too_small(world):
    engine = world.engine
    engine.take_load_stats()
    engine.generate([CharTokenizer().encode("12+34=")] * 8, SamplingConfig(n=1, max_tokens=60, temperature=1.0,
                                                                           min_tokens=60))
    load = engine.take_load_stats()
    assert load.preemptions > 0 and 1 <= load.max_running < 8 and load.max_waiting > 0
    assert engine.take_load_stats().preemptions == 0  # reset by the read

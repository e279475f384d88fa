"""Step-level rollout loop, runtime k, controllers and long-tail spot training.

The vLLM tests share ONE engine (tiny random Llama + EAGLE-3 draft, started with a
per-batch-size schedule so k can change at runtime); the rest are pure logic.
"""
from __future__ import annotations

import json

import pytest
import torch

from spectrain.config import ConfigError, load_config
from spectrain.rollout.engine import SamplingConfig
from spectrain.rollout.speculation.bandit import BanditSelector, SpecArm
from spectrain.rollout.speculation.calibration import load_verify_budget
from spectrain.rollout.speculation.controllers import BanditController, ConcurrencyController, FixedK, build_controller
from spectrain.rollout.speculation.long_tail import LongTailPolicy, LongTailTrainer
from spectrain.rollout.speculation.rule import ConcurrencyAwareRule
from spectrain.rollout.step_loop import SpecController, StepRecord
from tests.helpers import export_engine_models

K_MAX = 4


# ------------------------------------------------------------------------ pure logic
def record(live: int, k: int = 2, drafts: int = 0, accepted: int = 0, seconds: float = 0.01) -> StepRecord:
    return StepRecord(live, k, drafts, drafts * k, accepted, seconds, live + accepted)


def test_bandit_holds_each_arm_two_steps_and_rewards_the_second():
    selector = BanditSelector([SpecArm(1), SpecArm(3)], epsilon=0.0, seed=0)
    ctrl = BanditController(selector)
    ctrl.begin_rollout()
    ks = []
    # arm k1 verified in its 2nd step with 8 live, 8 accepted, 0.1 s: reward (1 + 8/8) * 8 / 0.1
    for live, accepted, seconds in [(8, 0, 0.5), (8, 8, 0.1), (8, 0, 0.5), (8, 24, 0.1), (8, 0, 0.5)]:
        ks.append(ctrl.before_step(live))
        ctrl.after_step(record(live, ks[-1], drafts=8, accepted=accepted, seconds=seconds))
    assert ks == [1, 1, 3, 3, 3]  # untried k1, then untried k3, then exploit the better (k3)
    assert selector.state_dict()["rewards"] == [[pytest.approx([160.0]), pytest.approx([320.0])]]
    assert ctrl.decisions == [("k1", "untried"), ("k3", "untried"), ("k3", "exploit")]
    assert ctrl.rollout_metrics() == {"bandit/k1_untried": 1.0, "bandit/k3_exploit": 1.0, "bandit/k3_untried": 1.0}
    restored = BanditController(BanditSelector([SpecArm(1), SpecArm(3)], epsilon=0.0, seed=0))
    restored.load_state_dict(json.loads(json.dumps(ctrl.state_dict())))
    assert restored.selector.state_dict() == selector.state_dict()


def test_long_tail_trainer_only_below_threshold_and_capped():
    calls = []
    trainer = LongTailTrainer(LongTailPolicy(threshold=4, max_updates=2), lambda: calls.append(1))
    trainer.begin_rollout()
    ran = [trainer.maybe_run(live) for live in (16, 8, 4, 3, 2, 1, 1)]
    assert ran == [False, False, False, True, True, False, False] and trainer.updates == 2
    trainer.begin_rollout()  # the cap is per rollout
    assert trainer.maybe_run(1) and len(calls) == 3


def test_verify_budget_missing_calibration_names_the_command(tmp_path):
    config = load_config("tiny_cpu_concurrency", [f"trainer.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="spectrain calibrate"):
        load_verify_budget(config, tmp_path)
    (tmp_path / "calibration.json").write_text(json.dumps({
        "verify_budget": 48, "floor_s": 1.0, "slope_s_per_token": 0.02, "token_counts": [1, 2, 4],
        "times_s": [1.0, 1.0, 1.0], "per_token_s": [1.0, 0.5, 0.25], "compute_bound_reached": False}))
    assert load_verify_budget(config, tmp_path) == 48


def test_recipes_switch_on_what_they_say():
    assert load_config("tiny_cpu_concurrency").speculation.mode == "concurrency"
    bandit = load_config("tiny_cpu_bandit")
    assert (bandit.speculation.mode == "bandit"
            and max(bandit.speculation.bandit.arms) <= bandit.draft.num_speculative_tokens)
    assert load_config("tiny_cpu_longtail").speculation.long_tail.enabled
    with pytest.raises(ConfigError, match="speculation.bandit.arms"):
        load_config("tiny_cpu_bandit", ["speculation.bandit.arms=[1,9]"])
    with pytest.raises(ConfigError, match="long_tail"):
        load_config("tiny_cpu_longtail", ["parallel.dp=2"])


def test_module_checkpoints_the_bandit_state():
    from spectrain.models.llama import LlamaConfig, LlamaForCausalLM
    from spectrain.train.module import GRPOModule

    config = load_config("tiny_cpu_bandit", ["speculation.verify_budget=16"])
    module = GRPOModule(config, LlamaForCausalLM(LlamaConfig()), None, None, None)
    controller = module.stepwise.controller = BanditController(BanditSelector([SpecArm(1), SpecArm(3)], epsilon=0.0,
                                                                               seed=0))
    controller.before_step(8)
    controller.after_step(record(8))
    controller.after_step(record(8, drafts=8, accepted=8))
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    resumed = GRPOModule(config, LlamaForCausalLM(LlamaConfig()), None, None, None)
    resumed.on_load_checkpoint(checkpoint)  # before the first rollout: kept until the controller is built
    assert resumed.stepwise.state_dict()["selector"]["counts"] == [[1, 0]]


# ------------------------------------------------------------------------ with vLLM
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("vllm")
    from spectrain.rollout.vllm.engine import VLLMRolloutEngine

    policy_dir, draft_dir = export_engine_models(tmp_path_factory.mktemp("step_loop"))
    eng = VLLMRolloutEngine(policy_dir, draft_dir, num_speculative_tokens=K_MAX, spec_schedule=[(1, 1, K_MAX)],
                            max_model_len=128, kv_cache_gib=1)
    yield eng
    eng.shutdown()


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1] + torch.randint(4, 80, (6,), generator=g).tolist() for _ in range(n)]


def long_tail(n: int) -> list[SamplingConfig]:
    """Per-request max_tokens 2, 3, 4, ...: one finishes (almost) every step."""
    return [SamplingConfig(max_tokens=2 + i, temperature=0.0) for i in range(n)]


class Recorder(SpecController):
    def __init__(self, k: int) -> None:
        self.k, self.lives, self.records, self.rollouts = k, [], [], 0

    def begin_rollout(self) -> None:
        self.rollouts += 1

    def before_step(self, live: int) -> int:
        self.lives.append(live)
        return self.k

    def after_step(self, rec: StepRecord) -> None:
        self.records.append(rec)


@pytest.mark.slow
def test_greedy_outputs_equal_generate(engine):
    from spectrain.rollout.step_loop import generate_stepwise

    engine.set_num_speculative_tokens(2)
    p, sampling = prompts(12), SamplingConfig(max_tokens=20, temperature=0.0)
    reference = engine.generate(p, sampling)
    result = generate_stepwise(engine, p, sampling)
    assert [(c.prompt_index, c.token_ids, c.finished) for c in result.completions] == \
        [(c.prompt_index, c.token_ids, c.finished) for c in reference]
    for a, b in zip(result.completions, reference):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert sum(r.tokens for r in result.trace) == result.num_tokens
    grouped = generate_stepwise(engine, p[:3], SamplingConfig(n=2, max_tokens=5, seed=0))
    assert [c.prompt_index for c in grouped.completions] == [0, 0, 1, 1, 2, 2]


@pytest.mark.slow
def test_live_batch_shrinks_on_a_long_tail(engine):
    from spectrain.rollout.step_loop import generate_stepwise

    ctrl = Recorder(k=0)
    result = generate_stepwise(engine, prompts(8), long_tail(8), controller=ctrl)
    lives = [r.live for r in result.trace]
    assert lives[0] == 8 and lives[-1] == 1 and lives == sorted(lives, reverse=True) and len(set(lives)) >= 6
    assert [len(c.token_ids) for c in result.completions] == [2 + i for i in range(8)]
    # the controller saw every step, before it ran, with the live batch the record reports
    assert ctrl.rollouts == 1 and ctrl.lives == lives and ctrl.records == result.trace


@pytest.mark.slow
def test_set_num_speculative_tokens_changes_vllm_drafting(engine):
    from spectrain.rollout.step_loop import generate_stepwise

    for k in (1, 3, 0):
        before = engine.spec_decode_counters()
        result = generate_stepwise(engine, prompts(4), SamplingConfig(max_tokens=16, temperature=0.0), FixedK(k))
        delta = engine.spec_decode_counters() - before
        assert all(r.k == k for r in result.trace)
        if k == 0:
            assert delta.num_drafts == 0
        else:  # vLLM's own counters: every draft carried exactly k tokens
            assert delta.num_drafts > 0 and delta.num_draft_tokens == k * delta.num_drafts
            assert sum(r.draft_tokens for r in result.trace) == delta.num_draft_tokens
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine.set_num_speculative_tokens(K_MAX + 1)


@pytest.mark.slow
def test_concurrency_and_bandit_controllers_set_k_per_step(engine):
    from spectrain.rollout.step_loop import generate_stepwise

    rule = ConcurrencyAwareRule(verify_budget=12, k_max=K_MAX)
    result = generate_stepwise(engine, prompts(8), long_tail(8), ConcurrencyController(rule))
    assert [r.k for r in result.trace] == [rule.num_speculative_tokens(r.live) for r in result.trace]
    assert result.trace[0].k < result.trace[-1].k == K_MAX  # deeper as sequences finish
    # vLLM verified what the previous step asked for
    for prev, cur in zip(result.trace, result.trace[1:]):
        assert cur.draft_tokens == prev.k * cur.drafts

    bandit = BanditController(BanditSelector([SpecArm(1), SpecArm(2), SpecArm(4)], epsilon=0.0, seed=0))
    result = generate_stepwise(engine, prompts(8), long_tail(8), bandit)
    assert len(bandit.decisions) == (len(result.trace) + 1) // 2
    assert sum(map(sum, bandit.selector.state_dict()["counts"])) == len(result.trace) // 2


@pytest.mark.slow
def test_long_tail_trainer_runs_between_steps_below_threshold(engine):
    from spectrain.rollout.step_loop import generate_stepwise

    live_at_call = []
    spot = LongTailTrainer(LongTailPolicy(threshold=3, max_updates=2),
                           lambda: live_at_call.append(engine.llm.llm_engine.get_num_unfinished_requests()))
    result = generate_stepwise(engine, prompts(8), long_tail(8), FixedK(0), idle_hook=spot)
    assert spot.updates == 2 and live_at_call == [2, 1]
    assert len(result.completions) == 8


@pytest.mark.slow
def test_build_controller_needs_a_runtime_k_engine(engine, tmp_path, monkeypatch):
    from spectrain.rollout.vllm.engine import RolloutEngineError

    config = load_config("tiny_cpu_bandit", [f"trainer.run_dir={tmp_path}", "speculation.verify_budget=16"])
    ctrl = build_controller(config, engine, tmp_path)
    assert isinstance(ctrl, BanditController) and [a.num_speculative_tokens for a in ctrl.selector.arms] == [1, 2, 3, 4]
    monkeypatch.setattr(engine, "draft_dir", None)  # as if started without a draft
    with pytest.raises(RolloutEngineError, match="spec_schedule"):
        build_controller(config, engine, tmp_path)


@pytest.mark.slow
def test_decode_step_times_fixed_length_decoding(engine, monkeypatch):
    """Calibration decodes `steps` tokens per sequence (min_tokens: no early EOS) at a fixed batch."""
    from spectrain.rollout.speculation import calibration
    from spectrain.rollout.step_loop import generate_stepwise

    engine.set_num_speculative_tokens(0)
    traces = []

    def recording(*args, **kwargs):
        traces.append(generate_stepwise(*args, **kwargs))
        return traces[-1]

    monkeypatch.setattr(calibration, "generate_stepwise", recording)
    tokens, seconds = calibration.decode_step(engine, batch=3, steps=4)
    assert tokens == 3 and seconds > 0
    result = traces[-1]
    assert [len(c.token_ids) for c in result.completions] == [5, 5, 5]
    decode = [r for r in result.trace if r.live == 3 and r.tokens == 3]
    assert len(decode) >= 4  # every step after the prefill is a pure decode step of the whole batch


def test_bench_headroom_picks_the_cheapest_k_per_live_bucket():
    """k=0 is cheapest per token with many live sequences, k=3 with few: the oracle mixes them."""
    from benchmarks.adaptive import headroom, live_bucket

    prefill = StepRecord(40, 0, 0, 0, 0, 1.0, 40)  # first step of every trace: skipped
    traces = {
        "no draft": [prefill, StepRecord(40, 0, 0, 0, 0, 0.001, 40)],  # another engine: ignored
        "fixed k=1": [prefill, StepRecord(40, 1, 40, 40, 40, 0.8, 80), StepRecord(2, 1, 2, 2, 2, 0.4, 4)],
        "fixed k=3": [prefill, StepRecord(40, 3, 40, 120, 80, 2.4, 120), StepRecord(2, 3, 2, 6, 4, 0.3, 6)],
        "concurrency": [prefill, StepRecord(40, 0, 0, 0, 0, 0.4, 40)],
    }
    room = headroom(traces, "fixed k=1")
    assert live_bucket(40) == "33+" and live_bucket(2) == "1-2" and live_bucket(3) == "3-4"
    assert room["tokens_by_bucket"] == {"33+": 80, "1-2": 4}
    assert room["ms_per_token"]["33+"] == pytest.approx({"0": 10.0, "1": 10.0, "3": 20.0})
    assert room["ms_per_token"]["1-2"] == pytest.approx({"1": 100.0, "3": 50.0})
    # fixed k=1: 80 x 10 + 4 x 100 = 1200 ms; oracle: 80 x 10 + 4 x 50 = 1000 ms
    assert room["oracle_vs_best_fixed"] == pytest.approx(1.2)

"""Adaptive speculation's decision logic: concurrency-aware rule, bandit, calibration, long tail."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest

from spectrain.errors import ConfigError, RunDirError
from spectrain.rollout.speculation.bandit import (
    BanditSelector,
    BatchBucket,
    SpecArm,
    accepted_tokens_per_second,
    buckets_by_verify_budget,
)
from spectrain.rollout.speculation.calibration import CalibrationResult, calibrate_verify_budget
from spectrain.rollout.speculation.long_tail import LongTailPolicy
from spectrain.rollout.speculation.rule import ConcurrencyAwareRule

# ------------------------------------------------------------------ concurrency rule

# C=64, k_max=4. By hand: (B, k = clamp(64 // B - 1, 0, 4))
CHAIN_TABLE = [(1, 4), (12, 4), (13, 3), (16, 3), (17, 2), (21, 2), (22, 1), (32, 1), (33, 0), (64, 0),
               (65, 0)]  # the batch alone exceeds the budget: no speculation


@pytest.mark.parametrize("b, k", CHAIN_TABLE)
def test_rule_chain_table(b, k):
    assert ConcurrencyAwareRule(verify_budget=64, k_max=4).num_speculative_tokens(b) == k


def test_rule_respects_budget_and_is_monotone():
    rule = ConcurrencyAwareRule(verify_budget=100, k_max=7)
    ks = [rule.num_speculative_tokens(b) for b in range(1, 200)]
    assert ks == sorted(ks, reverse=True)
    for b, k in zip(range(1, 200), ks):
        if k > 0:  # verify tokens of the step stay within C
            assert b * (k + 1) <= 100


# ------------------------------------------------------------------ bandit

ARMS = [SpecArm(0), SpecArm(2), SpecArm(4), SpecArm(6)]
TRUE_MEDIAN = {0: 100.0, 2: 180.0, 4: 250.0, 6: 200.0}


def synthetic_reward(arm: SpecArm, rng: random.Random) -> float:
    """Noisy tokens/s; the worst arm gets rare huge spikes that fool a mean but not a median."""
    k = arm.num_speculative_tokens
    r = TRUE_MEDIAN[k] + rng.gauss(0.0, 30.0)
    if k == 0 and rng.random() < 0.1:
        r *= 20.0
    return max(r, 0.0)


def run_bandit(sel: BanditSelector, steps: int, rng: random.Random, batch_size: int = 8):
    out = []
    for _ in range(steps):
        arm, reason = sel.select(batch_size)
        sel.update(arm, batch_size, synthetic_reward(arm, rng))
        out.append((arm, reason))
    return out


def test_bandit_untried_first_in_order():
    sel = BanditSelector(ARMS, epsilon=0.5, seed=1)
    first = run_bandit(sel, 4, random.Random(0))
    assert [(a.num_speculative_tokens, r) for a, r in first] == [
        (0, "untried"), (2, "untried"), (4, "untried"), (6, "untried")]
    assert all(r != "untried" for _, r in run_bandit(sel, 50, random.Random(1)))


@pytest.mark.parametrize("seed", range(8))
def test_bandit_finds_best_arm_and_explores_at_epsilon(seed):
    sel = BanditSelector(ARMS, epsilon=0.1, window=300, seed=seed)
    picks = run_bandit(sel, 2000, random.Random(1000 + seed))
    # epsilon-greedy can sit on the runner-up (k6) while k4's first samples are low; within
    # 300 steps it has always moved (worst of 500 seeds: step 206)
    exploit_after_300 = [a.num_speculative_tokens for a, r in picks[300:] if r == "exploit"]
    assert set(exploit_after_300) == {4}  # best median, despite k=0's spikes
    explore_frac = sum(r == "explore" for _, r in picks) / len(picks)
    assert abs(explore_frac - 0.1) <= 0.03, explore_frac


@pytest.mark.parametrize("seed", range(8))
def test_bandit_min_plays_finds_best_quickly(seed):
    """Three initial plays per arm make a misleading first sample rare (worst of 300 seeds: 80)."""
    sel = BanditSelector(ARMS, epsilon=0.1, seed=seed, min_plays=3)
    picks = run_bandit(sel, 150, random.Random(7 + seed))
    assert [r for _, r in picks[:12]] == ["untried"] * 12
    assert {a.num_speculative_tokens for a, r in picks[100:] if r == "exploit"} == {4}


def test_bandit_epsilon_zero_and_one():
    greedy = BanditSelector(ARMS, epsilon=0.0, seed=0)
    assert Counter(r for _, r in run_bandit(greedy, 200, random.Random(2)))["explore"] == 0
    explorer = BanditSelector(ARMS, epsilon=1.0, seed=0)
    reasons = Counter(r for _, r in run_bandit(explorer, 200, random.Random(2)))
    assert reasons == {"untried": 4, "explore": 196}


def test_bandit_window_forgets_old_rewards():
    """A drifting policy changes which arm is best; the sliding window lets the bandit follow."""
    sel = BanditSelector([SpecArm(1), SpecArm(3)], epsilon=0.1, window=20, seed=3)
    picks = []
    for step in range(600):
        arm, reason = sel.select(4)
        good = 3 if step < 300 else 1
        sel.update(arm, 4, 200.0 if arm.num_speculative_tokens == good else 100.0)
        picks.append((arm.name, reason))
    assert {arm for arm, reason in picks[-100:] if reason == "exploit"} == {"k1"}


def test_bandit_bucket_eligibility():
    buckets = [
        BatchBucket(1, 8, (SpecArm(0), SpecArm(2), SpecArm(4), SpecArm(6))),
        BatchBucket(9, 32, (SpecArm(0), SpecArm(2))),
        BatchBucket(33, None, (SpecArm(0),)),
    ]
    sel = BanditSelector(ARMS, buckets, epsilon=0.3, seed=0)
    rng = random.Random(0)
    for bs, allowed in ((1, {0, 2, 4, 6}), (8, {0, 2, 4, 6}), (9, {0, 2}), (32, {0, 2}),
                        (33, {0}), (1000, {0})):
        for _ in range(40):
            arm, _ = sel.select(bs)
            assert arm.num_speculative_tokens in allowed
            sel.update(arm, bs, synthetic_reward(arm, rng))
    # statistics are per bucket: bucket 9..32 (the second) played only k0 and k2
    assert [n > 0 for n in sel.state_dict()["counts"][1]] == [True, True, False, False]


def test_buckets_by_verify_budget():
    arms = [SpecArm(0), SpecArm(1), SpecArm(3), SpecArm(7)]
    buckets = buckets_by_verify_budget(arms, edges=[5, 17, 65], verify_budget=64)
    got = [(b.lo, b.hi, [a.num_speculative_tokens for a in b.arms]) for b in buckets]
    # lo * (k + 1) <= 64: lo=1 all; lo=5: k<=11 all; lo=17: k+1<=3 -> k<=2; lo=65: only k=0
    assert got == [(1, 4, [0, 1, 3, 7]), (5, 16, [0, 1, 3, 7]), (17, 64, [0, 1]), (65, None, [0])]
    only_spec = buckets_by_verify_budget([SpecArm(2), SpecArm(4)], edges=[100], verify_budget=64)
    assert only_spec[-1].arms == (SpecArm(2),)  # nothing fits: cheapest arm


def test_bandit_state_dict_round_trip_reproduces_future():
    buckets = buckets_by_verify_budget(ARMS, edges=[9], verify_budget=48)
    a = BanditSelector(ARMS, buckets, epsilon=0.2, window=30, seed=42)
    rng = random.Random(9)
    for i in range(150):
        arm, _ = a.select(1 + i % 16)
        a.update(arm, 1 + i % 16, synthetic_reward(arm, rng))
    state = json.loads(json.dumps(a.state_dict()))  # checkpoint-safe plain types
    b = BanditSelector(ARMS, buckets, epsilon=0.2, window=30, seed=999)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    rng_a, rng_b = random.Random(3), random.Random(3)
    for i in range(200):
        arm_a, why_a = a.select(1 + i % 16)
        arm_b, why_b = b.select(1 + i % 16)
        assert (arm_a, why_a) == (arm_b, why_b)
        a.update(arm_a, 1 + i % 16, synthetic_reward(arm_a, rng_a))
        b.update(arm_b, 1 + i % 16, synthetic_reward(arm_b, rng_b))
    assert a.state_dict() == b.state_dict()


def test_bandit_load_rejects_other_buckets():
    """A rerun `spectrain calibrate` moves the buckets under a run that resumes."""
    state = BanditSelector(ARMS, buckets_by_verify_budget(ARMS, [9], verify_budget=48)).state_dict()
    with pytest.raises(RunDirError, match="calibration.json"):
        BanditSelector(ARMS, buckets_by_verify_budget(ARMS, [9], verify_budget=8)).load_state_dict(state)


def test_accepted_tokens_per_second():
    assert accepted_tokens_per_second(3.0, 16, 0.5) == pytest.approx(96.0)
    assert accepted_tokens_per_second(1.0, 1, 0.01) == pytest.approx(100.0)


# ------------------------------------------------------------------ calibration

def roofline(n: int, floor_s: float = 0.01, per_token_s: float = 1e-4) -> float:
    """Synthetic forward: flat (memory-bound) until 100 tokens, then linear (compute-bound)."""
    return max(floor_s, per_token_s * n)


def smooth_knee(n: int) -> float:
    """A rounded roofline plus a small fixed overhead, knee near 100 tokens."""
    return 2e-4 + math.hypot(0.01, 1e-4 * n)


def affine(n: int) -> float:
    """Synthetic CPU-like forward: a fixed per-step overhead plus a cost per token."""
    return 0.01 + 1e-4 * n


def test_calibration_finds_ridge_point_of_roofline_and_affine_cost():
    counts = [2 ** i for i in range(11)]  # 1..1024
    res = calibrate_verify_budget(roofline, counts)
    assert res.verify_budget == 100  # floor 0.01 s / slope 1e-4 s per token
    assert res.floor_s == pytest.approx(0.01) and res.slope_s_per_token == pytest.approx(1e-4)
    assert res.compute_bound_reached
    cpu_like = calibrate_verify_budget(affine, counts)
    assert cpu_like.verify_budget == 101  # floor is the 1-token step: 0.0101 s
    assert affine(cpu_like.verify_budget) == pytest.approx(2 * affine(1), rel=0.01)


def test_calibration_smooth_curve():
    res = calibrate_verify_budget(smooth_knee, list(range(16, 2049, 16)))
    assert 100 <= res.verify_budget <= 106 and res.compute_bound_reached


def test_calibration_unsorted_input_and_json(tmp_path):
    res = calibrate_verify_budget(roofline, [512, 1, 64, 128, 1024, 8])
    assert res.token_counts == [1, 8, 64, 128, 512, 1024]
    assert res.times_s == [roofline(n) for n in res.token_counts]
    assert res.verify_budget == 100
    path = res.save(tmp_path / "run" / "verify_budget.json")
    raw = json.loads(path.read_text())
    assert raw["verify_budget"] == 100 and "compute-bound" in raw["definition"]
    assert CalibrationResult.load(path) == res


def test_calibration_flags_short_sweep():
    res = calibrate_verify_budget(roofline, [1, 4, 16, 64, 128, 256])
    assert res.verify_budget > 100 and not res.compute_bound_reached  # the fit starts at 64 < C, in the flat part
    flat = calibrate_verify_budget(roofline, [1, 4, 16, 64])  # all below C = 100: no growth to fit
    assert flat.verify_budget == 64 and flat.slope_s_per_token == 0.0 and not flat.compute_bound_reached
    assert "did not grow over the token counts [1, 4, 16, 64]" in flat.fallback
    assert "speculation.verify_budget=N" in flat.fallback


def test_calibration_on_a_busy_machine_never_stops_the_run():
    """Timings a busy machine scrambled: the largest counts got faster. The fit widens to every count from the
    fastest step on; where even that shows no growth, C falls back to the largest count, saying so."""
    busy = {1: 0.030, 2: 0.010, 4: 0.011, 8: 0.012, 16: 0.014, 32: 0.020, 64: 0.013, 128: 0.012}
    widened = calibrate_verify_budget(busy.__getitem__, busy)
    assert widened.fallback is None and widened.slope_s_per_token > 0 and widened.verify_budget >= 1
    flat = {1: 0.030, 2: 0.020, 4: 0.015, 8: 0.014, 16: 0.013}
    fallback = calibrate_verify_budget(flat.__getitem__, flat)
    assert fallback.verify_budget == 16 and "the machine was busy" in fallback.fallback


def test_calibration_needs_three_batch_sizes():
    """vLLM may run no larger batches (max_num_seqs, KV cache): the fix is a configured budget."""
    with pytest.raises(ConfigError, match=r">= 3 distinct token counts, got \[64, 128\].*speculation.verify_budget=N"):
        calibrate_verify_budget(roofline, [64, 128, 128])


# ------------------------------------------------------------------ long tail

def test_long_tail_thresholds_and_max_updates():
    policy = LongTailPolicy(threshold=4, max_updates=2)
    assert [policy.should_train(b, 0) for b in (0, 1, 3, 4, 5, 64)] == [False, True, True, False, False, False]
    assert [policy.should_train(2, updates_taken=s) for s in range(4)] == [True, True, False, False]

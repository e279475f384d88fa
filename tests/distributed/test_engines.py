"""One vLLM engine per TP group of ranks, on two real processes over gloo (spectrain/rollout/engine_layout.py).

- 2 ranks x 1 engine each: each engine serves its contiguous share of the prompts with per-request seeds; the
  gathered rollout equals what one engine returns for the whole batch (greedy and sampled), GRPO groups intact;
  the counters are the sum over the engines; after a sync both engines pass the weight probe, and a fault on
  engine 1 alone is caught and named; a bandit on each rank over the lockstepped step loop sets the same k on
  both engines at every engine step.
- TP=2 over 2 ranks: one engine, both ranks submit the same requests and get the same tokens, without a hang;
  each rank probes its own shards of the policy and the drafter, and a fault loaded by rank 1 alone is named.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from spectrain.parallel.spawn import run_distributed
from spectrain.rollout.engine import SamplingConfig
from tests.helpers import export_engine_models

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

PROMPTS, SAMPLES, MAX_TOKENS = 6, 3, 12


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1] + torch.randint(4, 80, (4 + i % 3,), generator=g).tolist() for i in range(PROMPTS)]


def _start_engine(rank: int, world: int, tp: int, models):
    """This rank's part of its engine, as `SpecTrainer` starts it (torchrun's variables, then vLLM's groups)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from spectrain.rollout.engine_layout import EngineLayout
    from spectrain.rollout.vllm.dist import prepare_process_groups
    from spectrain.rollout.vllm.engine import VLLMRolloutEngine

    torch.set_num_threads(1)
    prepare_process_groups(tp)
    policy_dir, draft_dir = models
    engine = VLLMRolloutEngine(policy_dir, draft_dir, num_speculative_tokens=3, spec_schedule=[(1, 1, 3)],
                               max_model_len=64, kv_cache_gib=1, tensor_parallel_size=tp, external_launcher=True)
    return engine, EngineLayout(world // tp, tp, rank)


def _rollout(engine, layout, sampling: SamplingConfig, share: range):
    """`GRPOModule.rollout`'s engine side: this share's seeded requests, global prompt indices, the counter delta."""
    from dataclasses import replace

    from spectrain.rollout.engine_layout import EngineRollout, seeded_configs

    prompts = _prompts()
    before = engine.spec_decode_counters()
    completions = engine.generate([prompts[i] for i in share], seeded_configs(sampling, share, 0, "train", 3))
    completions = [replace(c, prompt_index=share[c.prompt_index]) for c in completions]
    return EngineRollout(completions, engine.spec_decode_counters() - before,
                         engine.take_load_stats(), 0.0)


def _tokens(completions) -> list[tuple[int, list[int]]]:
    return [(c.prompt_index, c.token_ids) for c in completions]


def _two_engines(rank: int, world: int, models):
    from spectrain.rollout.engine_layout import merge

    engine, layout = _start_engine(rank, world, 1, models)
    assert layout.num_engines == 2 and layout.is_leader and layout.engine_index == rank
    out = {}
    for name, sampling in (("greedy", SamplingConfig(n=1, max_tokens=MAX_TOKENS, temperature=0.0)),
                           ("sampled", SamplingConfig(n=SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0))):
        parts = layout.gather(_rollout(engine, layout, sampling, layout.prompt_range(PROMPTS)))
        whole = _rollout(engine, layout, sampling, range(PROMPTS))  # this engine alone, the whole batch
        out[name] = dict(merged=merge(parts), parts=parts, alone=whole)
    out["lockstep"] = _adaptive_in_lockstep(engine, layout)

    # sync: every engine loads the same new weights and passes the probe; then engine 1 alone gets a fault
    sync, module, weights = _synced(engine, layout, models)
    out["probe_after_sync"] = sync._probe(module, "policy", weights)
    if rank == 1:
        engine.sync_policy(_faulty(weights, "model.layers.1.mlp.down_proj.weight"), 2)
    out["probe_after_fault"] = sync._probe(module, "policy", weights)
    engine.shutdown()
    return out


def _synced(engine, layout, models):
    """The policy scaled by 1.01, synced into the engine: (the sync callback, the module it reads, the weights)."""
    from callbacks.weight_sync import WeightSync
    from spectrain.models.hf_io import load_pretrained
    from spectrain.parallel.plan import LocalPlan

    policy = load_pretrained(models[0])
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.01)
    weights = LocalPlan().policy_weights(policy)
    engine.sync_policy(weights, 1)
    return WeightSync(check_alive=False), SimpleNamespace(engines=layout, engine=engine, config=None,
                                                          policy=policy), weights


def _faulty(weights, *names: str):
    return [(n, t * 2 if n in names else t) for n, t in weights]


def _adaptive_in_lockstep(engine, layout):
    """A bandit on each rank over the lockstepped step loop. Engine 0 gets 1 prompt for 3 tokens and engine 1 gets 5
    for MAX_TOKENS, so engine 0 finishes first and waits for engine 1."""
    from spectrain.rollout.speculation.bandit import BanditSelector, SpecArm
    from spectrain.rollout.speculation.controllers import BanditController
    from spectrain.rollout.step_loop import EngineLockstep, generate_stepwise

    share = range(1) if layout.engine_index == 0 else range(1, PROMPTS)
    controller = BanditController(BanditSelector([SpecArm(k) for k in (1, 2, 3)], epsilon=0.5, seed=0, min_plays=1))
    greedy = SamplingConfig(n=1, max_tokens=3 if layout.engine_index == 0 else MAX_TOKENS, temperature=0.0)
    prompts = _prompts()
    result = generate_stepwise(engine, [prompts[i] for i in share], greedy, controller,
                               lockstep=EngineLockstep(layout.is_leader))
    completions = [(share[c.prompt_index], c.token_ids) for c in result.completions]
    return dict(trace=result.trace, tokens=completions, selector=controller.selector.state_dict(),
                decisions=controller.decisions)


def test_two_engines_serve_one_rollout_sync_and_are_probed_each(tmp_path):
    models = export_engine_models(tmp_path)
    results = run_distributed(_two_engines, 2, models, timeout=600)
    got_greedy = results[0]["greedy"]["merged"]
    for name in ("greedy", "sampled"):
        got = [r[name] for r in results]
        merged, alone = got[0]["merged"], got[0]["alone"]
        assert _tokens(merged.completions) == _tokens(got[1]["merged"].completions)  # every rank: the whole rollout
        # GRPO groups intact and in order: prompt 0's samples, then prompt 1's...
        n = 1 if name == "greedy" else SAMPLES
        assert [c.prompt_index for c in merged.completions] == [i for i in range(PROMPTS) for _ in range(n)]
        assert [c.prompt_index for c in got[0]["parts"][0].completions] == [i for i in range(3) for _ in range(n)]
        # the same tokens as one engine serving the whole batch with the same seeds
        assert _tokens(merged.completions) == _tokens(alone.completions), name
        # counters: the sum over the engines' own deltas, each engine counted once
        parts = got[0]["parts"]
        assert merged.spec.num_drafts == parts[0].spec.num_drafts + parts[1].spec.num_drafts > 0
        assert merged.spec.num_accepted_tokens == sum(p.spec.num_accepted_tokens for p in parts)
        assert merged.per_engine_acceptance == [p.spec.mean_acceptance_length for p in parts]
    # adaptive k in lockstep: the same records, decisions and bandit state on both ranks, so the same k on both
    # engines at every engine step, past the step where engine 0 ran out of requests; speculation stays lossless
    steps = [r["lockstep"] for r in results]
    assert steps[0]["trace"] == steps[1]["trace"] and steps[0]["decisions"] == steps[1]["decisions"]
    assert steps[0]["selector"] == steps[1]["selector"]
    assert len({r.k for r in steps[0]["trace"]}) > 1, steps[0]["trace"]  # the bandit explored: k changed
    assert sum(r.drafts for r in steps[0]["trace"]) > 0
    whole = _tokens(got_greedy.completions)
    assert steps[0]["tokens"] == [(0, whole[0][1][:3])] and steps[1]["tokens"] == whole[1:]
    for r in results:
        assert r["probe_after_sync"] == []
        found = r["probe_after_fault"]  # the same on both ranks: engine 1 only, named
        assert found and all(p.startswith("engine 1 (rank 1): ") for p in found), found
        assert any("model.layers.1.mlp.down_proj" in p for p in found), found


def _tensor_parallel(rank: int, world: int, models):
    from safetensors.torch import load_file

    engine, layout = _start_engine(rank, world, 2, models)
    assert layout.num_engines == 1 and layout.is_leader == (rank == 0)
    rollout = _rollout(engine, layout, SamplingConfig(n=SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0),
                       layout.prompt_range(PROMPTS))
    greedy = _rollout(engine, layout, SamplingConfig(n=1, max_tokens=MAX_TOKENS, temperature=0.0), range(PROMPTS))
    # every TP rank probes its own shards: after a sync all pass; a fault loaded by rank 1 alone is named there
    sync, module, weights = _synced(engine, layout, models)
    draft = sorted((n, t) for n, t in load_file(models[1] / "model.safetensors").items() if n != "t2d")  # as synced
    engine.sync_draft(draft, 1)
    probes = {which: sync._probe(module, which, sent) for which, sent in (("policy", weights), ("draft", draft))}
    if rank == 1:  # a row-parallel layer (input columns split) and a fused column-parallel one (output rows split)
        engine.sync_policy(_faulty(weights, "model.layers.1.mlp.down_proj.weight",
                                   "model.layers.2.self_attn.k_proj.weight"), 2)
        engine.sync_draft(_faulty(draft, "midlayer.mlp.gate_proj.weight"), 2)
    probes.update(policy_fault=sync._probe(module, "policy", weights),
                  draft_fault=sync._probe(module, "draft", draft))
    engine.shutdown()
    return _tokens(rollout.completions), _tokens(greedy.completions), rollout.spec.num_drafts, probes


def test_tensor_parallel_engine_over_two_ranks_gives_both_the_same_tokens_and_probes_every_shard(tmp_path):
    models = export_engine_models(tmp_path)
    (sampled_0, greedy_0, drafts_0, probes_0), (sampled_1, greedy_1, drafts_1, probes_1) = run_distributed(
        _tensor_parallel, 2, models, timeout=600)
    assert len(sampled_0) == PROMPTS * SAMPLES and sampled_0 == sampled_1
    assert greedy_0 == greedy_1 and drafts_0 == drafts_1 > 0
    assert probes_0 == probes_1  # the same verdict on every rank
    assert probes_0["policy"] == [] and probes_0["draft"] == []
    for which, layers in (("policy_fault", ("model.layers.1.mlp.down_proj", "model.layers.2.self_attn.qkv_proj")),
                          ("draft_fault", ("gate_up_proj",))):
        found = probes_0[which]
        assert found and all(p.startswith("engine 0 (rank 1): ") for p in found), found
        assert all(any(layer in p for p in found) for layer in layers), found

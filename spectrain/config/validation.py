"""`validate`: every impossible value refused at load time, naming the key and the fix."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from spectrain.config.schema import (
    PP_STAGES_PER_RANK,
    VLLM_KWARGS_SET_BY_SPECTRAIN,
    Accelerator,
    AttentionBackend,
    DraftInit,
    DraftLossKernel,
    DraftMode,
    EngineRanks,
    KlLossType,
    LossAggMode,
    LrScheduler,
    OnBadRow,
    OnDead,
    OnMismatch,
    PipelineSchedule,
    PolicyDtype,
    Resume,
    RewardName,
    RolloutDtype,
    RolloutEngine,
    SpecTrainConfig,
    SpeculationMode,
    TaskName,
    TopKMetric,
    TopKMode,
    engines_on_every_rank,
)
from spectrain.errors import ConfigError, warn_input


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _one_of(value: str, key: str, allowed) -> None:
    """`value` among `allowed`: a tuple, or a `Literal` alias of schema.py (omegaconf refuses other values at load
    time; a config built in Python reaches this check)."""
    allowed = get_args(allowed) or tuple(allowed)
    _require(value in allowed, key, f"'{value}' is not one of {list(allowed)}")


def check_pipeline_fits(par, num_hidden_layers: int, tie_word_embeddings: bool, checkpoint: str | None = None) -> None:
    """The stages fit the policy's layers, and no weight is shared between the first and the last stage.
    At load time for the toy policy; for a `checkpoint` (policy.path) once its config.json is read."""
    stages = par.pp * PP_STAGES_PER_RANK[par.pp_schedule]
    per_rank = "" if stages == par.pp else f" ({par.pp_schedule} runs {stages // par.pp} per rank)"
    policy = f"the checkpoint {checkpoint}" if checkpoint else "the policy"
    _require(stages <= num_hidden_layers, "parallel.pp",
             f"{stages} pipeline stages{per_rank} but {policy} has only {num_hidden_layers} layers; lower "
             f"parallel.pp" + ("" if checkpoint else ", raise toy.num_hidden_layers")
             + (" or use pp_schedule=1F1B" if per_rank else ""))
    _require(not tie_word_embeddings, "toy.tie_word_embeddings",
             f"{policy} ties its embeddings, which would put lm_head.weight on the first and the last stage; "
             + ("use parallel.pp=1" if checkpoint else "set it false or parallel.pp=1"))


def _check_pipeline(c: SpecTrainConfig) -> None:
    """What `PipelinePlan` and torch's schedules would reject mid-run, rejected at load time."""
    toy, par = c.toy, c.parallel
    stages = par.pp * PP_STAGES_PER_RANK[par.pp_schedule]
    if c.policy.path is None:  # a checkpoint's layers are checked when its config.json is read
        check_pipeline_fits(par, toy.num_hidden_layers, toy.tie_word_embeddings)
    _require(par.pp_schedule != "1F1B" or par.microbatches >= stages, "parallel.microbatches",
             f"1F1B needs at least one microbatch per stage ({stages}), got {par.microbatches}; raise "
             f"parallel.microbatches to >= {stages} or use parallel.pp_schedule=GPipe")
    rounds = max(1, par.microbatches // par.pp)
    _require(par.pp_schedule != "Interleaved1F1B" or par.microbatches % rounds == 0, "parallel.microbatches",
             f"Interleaved1F1B runs microbatches in rounds of parallel.pp={par.pp}: {par.microbatches} is not a "
             f"multiple of its {rounds} rounds; use a multiple of {par.pp}")
    docs = c.rollout.prompts_per_step * c.rollout.n // c.grpo.minibatches  # the smallest update's
    _require(docs >= par.dp * par.microbatches, "parallel.microbatches",
             f"each of parallel.dp={par.dp} ranks cuts its documents into {par.microbatches} microbatches, but an "
             f"update has only {docs} (rollout.prompts_per_step x rollout.n / grpo.minibatches); lower "
             f"parallel.microbatches or grpo.minibatches, or send more")


# sizes and counts that anything downstream divides by, loops over or allocates from
_AT_LEAST_ONE = (
    "toy.hidden_size", "toy.intermediate_size", "toy.num_hidden_layers", "toy.num_attention_heads",
    "toy.num_key_value_heads", "toy.max_position_embeddings", "toy.digits", "sft.batch_size",
    "rollout.prompts_per_step", "rollout.response_length", "rollout.max_model_len", "eval.prompts",
    "grpo.minibatches", "grpo.ppo_epochs", "draft.num_speculative_tokens", "draft.ttt_passes", "draft.every_n_steps",
    "draft.max_held_steps",
    "parallel.dp", "parallel.cp", "parallel.pp", "parallel.microbatches", "speculation.bandit.window",
    "speculation.bandit.min_plays", "speculation.long_tail.threshold", "trainer.log_every_n_steps",
    "trainer.checkpoint_every_n_steps", "trainer.log_samples_n", "speculation.measure_speedup_prompts",
)
_AT_LEAST_ZERO = ("draft.warmup_steps", "draft.lr_ramp_updates", "grpo.kl_loss_coef", "grpo.weight_decay",
                  "speculation.long_tail.max_updates", "trainer.max_steps", "eval.every_n_steps",
                  "trainer.log_samples_every_n_steps", "speculation.measure_speedup_every_n_steps")
_POSITIVE = ("sft.lr", "grpo.lr", "grpo.clip_ratio", "grpo.adv_eps", "grpo.grad_clip", "draft.lr", "draft.warmup_lr",
             "draft.grad_clip")
_MAX_SEED = 2**32 - 1  # Lightning's seed_everything accepts 0..2^32-1


def _value(c: SpecTrainConfig, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), c)


def _check_ranges(c: SpecTrainConfig) -> None:
    """The plain bounds, first: later checks divide by these values."""
    for key in _AT_LEAST_ONE:
        _require(_value(c, key) >= 1, key, f"is {_value(c, key)}; it must be >= 1")
    for key in _AT_LEAST_ZERO:
        _require(_value(c, key) >= 0, key, f"is {_value(c, key)}; it must be >= 0")
    for key in _POSITIVE:
        _require(_value(c, key) > 0, key, f"is {_value(c, key)}; it must be > 0 (e.g. the default "
                                          f"{_value(SpecTrainConfig(), key)})")


def _check_policy(c: SpecTrainConfig) -> None:
    _one_of(c.policy.dtype, "policy.dtype", PolicyDtype)
    _one_of(c.policy.attention_backend, "policy.attention_backend", AttentionBackend)
    _one_of(c.rollout.dtype, "rollout.dtype", RolloutDtype)
    if c.policy.path is not None:  # the checkpoint's config.json decides the architecture (checked when it is read)
        return
    p = c.toy
    _require(p.num_attention_heads % p.num_key_value_heads == 0, "toy.num_key_value_heads",
             f"num_attention_heads={p.num_attention_heads} must be a multiple of it")
    _require(p.hidden_size % p.num_attention_heads == 0, "toy.hidden_size",
             f"must be divisible by num_attention_heads={p.num_attention_heads}")
    head_dim = p.hidden_size // p.num_attention_heads
    _require(head_dim % 2 == 0, "toy.hidden_size", f"hidden_size / num_attention_heads = {head_dim} must be even "
             f"(rotary embeddings rotate pairs of dimensions)")
    _require(c.rollout.max_model_len <= p.max_position_embeddings, "rollout.max_model_len",
             f"{c.rollout.max_model_len} exceeds toy.max_position_embeddings={p.max_position_embeddings}; "
             f"raise the latter or lower the former")


def _check_task(c: SpecTrainConfig) -> None:
    t, data = c.task, c.data
    _one_of(t.name, "task.name", TaskName)
    _require(t.name != "files" or bool(data.train_files), "data.train_files",
             "task.name=files needs data.train_files=/path/to/train.jsonl (or .parquet, or a list of files)")
    _require(t.name == "files" or not data.train_files, "task.name",
             f"is {t.name}, but data.train_files is set; set task.name=files to train on the files")
    _require(c.toy.operands >= 2, "toy.operands", f"is {c.toy.operands}; an arithmetic prompt needs >= 2 operands")
    _one_of(data.on_bad_row, "data.on_bad_row", OnBadRow)
    _require(data.max_prompt_length is None or data.max_prompt_length >= 1, "data.max_prompt_length",
             f"is {data.max_prompt_length}; give a token count >= 1, or null for no limit")
    _require(data.prompt_template is None or "{prompt}" in data.prompt_template, "data.prompt_template",
             f"{data.prompt_template!r} has no {{prompt}} placeholder; e.g. '{{prompt}} Answer after ####.'")
    _require(c.sft.enabled is False or c.sft.steps >= 1, "sft.steps",
             f"is {c.sft.steps}; it must be >= 1 (set sft.enabled=false to skip the warm start)")


def _check_reward(c: SpecTrainConfig) -> None:
    r = c.reward
    _one_of(r.name, "reward.name", RewardName)
    _require(0 <= r.partial_credit < 1, "reward.partial_credit",
             f"is {r.partial_credit}; it must be in [0, 1): a wrong answer must score below a right one")
    _require(r.name != "custom" or bool(r.path), "reward.path",
             "reward.name=custom needs reward.path=/path/to/reward.py (with reward.function, default compute_score)")
    _require(r.timeout_s > 0, "reward.timeout_s", f"is {r.timeout_s}; give seconds > 0")


def _check_torch_engine(c: SpecTrainConfig) -> None:
    """`rollout.engine=torch` never speculates: what tunes vLLM's speculation or vLLM itself has nothing to act on.
    (The draft's alive check and acceptance logging see zero drafts and skip: no need to turn them off.)"""
    s, r = c.speculation, c.rollout
    fix = "or use rollout.engine=vllm"
    _require(s.mode not in ("concurrency", "bandit"), "speculation.mode", f"'{s.mode}' adapts the engine's "
             f"speculation depth, but rollout.engine=torch does not speculate; set speculation.mode=fixed {fix}")
    _require(not s.long_tail.enabled, "speculation.long_tail.enabled", f"spot training runs in vLLM's step loop, "
             f"which rollout.engine=torch does not have; set speculation.long_tail.enabled=false {fix}")
    _require(not s.measure_speedup_every_n_steps, "speculation.measure_speedup_every_n_steps", "compares decoding "
             f"with and without speculation, but rollout.engine=torch does not speculate; set it to 0 {fix}")
    _require(not r.vllm_kwargs, "rollout.vllm_kwargs", f"{dict(r.vllm_kwargs)} would be ignored by "
             f"rollout.engine=torch (they are vllm.LLM arguments); drop them {fix}")
    _require(r.tensor_parallel_size == 1, "rollout.tensor_parallel_size", f"is {r.tensor_parallel_size}, but "
             f"rollout.engine=torch runs on one device; set it to 1 {fix}")


def _check_engine_groups(c: SpecTrainConfig) -> None:
    """`rollout.engine_ranks=all` starts one vLLM engine per TP group of `rollout.tensor_parallel_size` ranks: the
    groups must tile the ranks (adaptive k keeps their step loops in lockstep). The torch engine drives one engine,
    on rank 0 (long-tail spot training is refused above one rank, so it always has one engine)."""
    r, p, tp = c.rollout, c.parallel, c.rollout.tensor_parallel_size
    _one_of(r.engine_ranks, "rollout.engine_ranks", EngineRanks)
    if r.engine_ranks == "all":
        _require(r.engine == "vllm", "rollout.engine_ranks", "is all, but rollout.engine=torch runs one engine on "
                 "rank 0; set rollout.engine_ranks=auto (or rank0), or rollout.engine=vllm")
    world = p.dp * p.cp * p.pp
    if world == 1 or not engines_on_every_rank(c):
        return
    _require(world % tp == 0, "rollout.tensor_parallel_size",
             f"is {tp}, which does not divide the {world} ranks (parallel.dp x cp x pp): each engine is a group of "
             f"rollout.tensor_parallel_size consecutive ranks; pick a divisor of {world} (1: one engine per rank, "
             f"{world}: one engine over all of them)")


def _check_rollout(c: SpecTrainConfig) -> None:
    r = c.rollout
    _one_of(r.engine, "rollout.engine", RolloutEngine)
    if r.engine == "torch":
        _check_torch_engine(c)
    _require(r.n >= 2, "rollout.n",
             f"is {r.n}; GRPO normalises rewards within a group, so it needs >= 2 samples per prompt")
    _require(c.eval.samples >= 2, "eval.samples",
             f"is {c.eval.samples}; the held-out standard error needs >= 2 samples per prompt")
    _require(r.temperature > 0, "rollout.temperature",
             f"is {r.temperature}; GRPO needs sampling (greedy decoding gives a group identical completions and "
             f"so no advantage): use a temperature > 0, e.g. 1.0")
    _require(0 < r.top_p <= 1, "rollout.top_p", f"is {r.top_p}; it must be in (0, 1]")
    _require(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
             f"is {r.gpu_memory_utilization}; give vLLM's share of the GPU, in (0, 1], e.g. 0.6")
    _require(r.tensor_parallel_size >= 1, "rollout.tensor_parallel_size",
             f"is {r.tensor_parallel_size}; it must be >= 1")
    _check_engine_groups(c)
    _require(r.kv_cache_gib > 0, "rollout.kv_cache_gib",
             f"is {r.kv_cache_gib}; give the vLLM KV cache size in GiB, > 0 (fractions are honoured, e.g. 0.5)")
    managed = sorted(set(r.vllm_kwargs) & set(VLLM_KWARGS_SET_BY_SPECTRAIN))
    _require(not managed, "rollout.vllm_kwargs",
             f"sets {managed}, which spectrain sets itself: use policy.path, tokenizer.path, rollout.dtype, "
             f"rollout.max_model_len, rollout.kv_cache_gib, rollout.gpu_memory_utilization, "
             f"rollout.tensor_parallel_size, rollout.enforce_eager, rollout.enable_prefix_caching, "
             f"rollout.enable_sleep_mode, draft.* and trainer.seed instead, and drop them from rollout.vllm_kwargs")


def _check_micro_batches(c: SpecTrainConfig) -> None:
    """A document is never split across micro-batches; a pipeline's microbatches must each hold the longest."""
    chunk = c.policy.logprob_chunk_tokens
    _require(chunk is None or chunk >= 1, "policy.logprob_chunk_tokens", f"is {chunk}; give a token count >= 1 "
             f"(e.g. 4096), or null for whole [T, V] logits")
    tokens, par, r = c.grpo.micro_batch_tokens, c.parallel, c.rollout
    if tokens is None:
        return
    _require(tokens >= 1, "grpo.micro_batch_tokens", f"is {tokens}; give a token count per rank >= 1 (e.g. 16384), "
             f"or null for the whole minibatch in one forward")
    longest = r.max_model_len if par.cp == 1 else -(-r.max_model_len // (2 * par.cp)) * 2  # its zigzag shard
    _require(par.pp == 1 or tokens >= longest, "grpo.micro_batch_tokens",
             f"is {tokens}, but a pipeline microbatch must hold a whole document: up to {longest} tokens per rank "
             f"(rollout.max_model_len={r.max_model_len}, parallel.cp={par.cp}); raise it to >= {longest}")


def _check_grpo(c: SpecTrainConfig) -> None:
    _check_micro_batches(c)
    g, r, par = c.grpo, c.rollout, c.parallel
    _require(g.kl_loss_coef == 0 or (par.cp == 1 and par.pp == 1), "grpo.kl_loss_coef",
             "the KL term needs whole documents on one rank: set parallel.cp=1 and parallel.pp=1, or "
             "grpo.kl_loss_coef=0")
    docs = r.prompts_per_step * r.n
    _require(g.minibatches * par.dp <= docs, "grpo.minibatches",
             f"times parallel.dp={par.dp} must be in [1, rollout.prompts_per_step * rollout.n = {docs}]: "
             f"every data-parallel rank needs at least one completion per minibatch")
    _check_grpo_options(c)


def _check_grpo_options(c: SpecTrainConfig) -> None:
    """The verl-named loss options (docs/your_model.md, "GRPO loss options")."""
    g, r = c.grpo, c.rollout
    _one_of(g.loss_agg_mode, "grpo.loss_agg_mode", LossAggMode)
    _one_of(g.kl_loss_type, "grpo.kl_loss_type", KlLossType)
    _one_of(g.reference_dtype, "grpo.reference_dtype", PolicyDtype)
    _one_of(g.lr_scheduler, "grpo.lr_scheduler", LrScheduler)
    for key in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(g, key)
        _require(value is None or value > 0, f"grpo.{key}",
                 f"is {value}; it must be > 0 (e.g. 0.2, or 0.28 for DAPO's clip-higher), or null for grpo.clip_ratio")
    _require(g.clip_ratio_low is None or g.clip_ratio_low < 1, "grpo.clip_ratio_low",
             f"is {g.clip_ratio_low}; it must be < 1 (the ratio's lower bound 1 - clip_ratio_low must stay > 0), "
             f"e.g. 0.2")
    _require(0 <= g.overlong_buffer_len <= r.response_length, "grpo.overlong_buffer_len",
             f"is {g.overlong_buffer_len}; it must be in [0, rollout.response_length={r.response_length}] (the last "
             f"tokens before the length limit over which the penalty grows), e.g. {max(1, r.response_length // 4)}, "
             f"or 0 to turn the overlong penalty off")
    _require(g.overlong_penalty_factor >= 0, "grpo.overlong_penalty_factor",
             f"is {g.overlong_penalty_factor}; it must be >= 0 (the reward lost at rollout.response_length), e.g. 1.0")
    _require(g.lr_warmup_steps >= 0, "grpo.lr_warmup_steps",
             f"is {g.lr_warmup_steps}; give a number of GRPO steps >= 0 (0: no warm-up)")
    par = c.parallel
    _require(not g.dynamic_sampling or par.dp * par.pp == 1, "grpo.dynamic_sampling",
             f"drops documents per step, but parallel.dp={par.dp} and parallel.pp={par.pp} split each update's "
             f"documents over ranks and microbatches by fixed counts; use it with parallel.dp=1 and parallel.pp=1 "
             f"(cp is fine), "
             f"or set grpo.dynamic_sampling=false")


def _check_draft(c: SpecTrainConfig) -> None:
    d, layers = c.draft, c.toy.num_hidden_layers
    _one_of(d.mode, "draft.mode", DraftMode)
    _one_of(d.init, "draft.init", DraftInit)
    _one_of(d.loss_kernel, "draft.loss_kernel", DraftLossKernel)
    _require(d.init != "path" or bool(d.path), "draft.path",
             "draft.init=path needs draft.path=/path/to/eagle3_draft (a vLLM / SpecForge EAGLE-3 directory)")
    _require(d.draft_vocab_size is None or d.draft_vocab_size >= 2, "draft.draft_vocab_size",
             f"is {d.draft_vocab_size}; the stop token always takes one of its ids, so the draft could propose "
             f"nothing else: give >= 2 (e.g. 32000), or null for the policy's vocabulary")
    _require(0 <= d.hold_tolerance < 1, "draft.hold_tolerance",
             f"is {d.hold_tolerance}; it must be in [0, 1): 0 updates the draft every draft.every_n_steps steps, "
             f"e.g. 0.05 skips updates while acceptance stays within 5% of its recent best")
    if c.policy.path is not None:
        return  # the layer count comes from the checkpoint: checked when the draft is built
    _require(0 < d.pass_decay <= 1, "draft.pass_decay", f"is {d.pass_decay}; it must be in (0, 1]")
    if d.tap_layers is not None:
        bad = [i for i in d.tap_layers if not 0 <= i < layers]
        _require(not bad and len(d.tap_layers) == 3, "draft.tap_layers",
                 f"{list(d.tap_layers)} must be 3 layer ids in 0..{layers - 1}, e.g. draft.tap_layers=[0,1,2]")
    elif d.mode != "none":
        _require(layers >= 4, "toy.num_hidden_layers",
                 "EAGLE-3's default aux layers (2, n//2, n-3) need >= 4 layers; set draft.tap_layers")


def _check_parallel(c: SpecTrainConfig) -> None:
    par = c.parallel
    _one_of(par.pp_schedule, "parallel.pp_schedule", PipelineSchedule)
    if par.pp > 1:
        _check_pipeline(c)
    if par.fsdp:
        _require(par.dp * par.cp > 1, "parallel.fsdp", "shards over the parallel.dp x parallel.cp ranks, but both are "
                 "1: there is nothing to shard over; raise parallel.dp (or parallel.cp), or set parallel.fsdp=false")


def _check_speculation(c: SpecTrainConfig) -> None:
    s, d, par = c.speculation, c.draft, c.parallel
    b = s.bandit
    _one_of(s.mode, "speculation.mode", SpeculationMode)
    _require(s.verify_budget is None or s.verify_budget >= 1, "speculation.verify_budget",
             f"is {s.verify_budget}; it must be >= 1 tokens, or null to read the run's calibration")
    _require(0 <= b.epsilon <= 1, "speculation.bandit.epsilon", f"is {b.epsilon}; it must be in [0, 1]")
    _require(b.min_plays <= b.window, "speculation.bandit.min_plays",
             f"is {b.min_plays}; it must be <= speculation.bandit.window={b.window}")
    edges = [1, *b.bucket_edges]
    _require(all(lo < hi for lo, hi in zip(edges, edges[1:])), "speculation.bandit.bucket_edges",
             f"{list(b.bucket_edges)} must be strictly increasing batch sizes > 1, e.g. [4, 16, 64]")
    _require(s.mode == "fixed" or d.mode != "none", "speculation.mode",
             f"'{s.mode}' adapts the draft's k, but draft.mode=none; use speculation.mode=fixed")
    _require(not s.measure_speedup_every_n_steps or d.mode != "none", "speculation.measure_speedup_every_n_steps",
             "compares decoding with and without the draft, but draft.mode=none; set it to 0, or use a draft")
    _require(not s.measure_speedup_every_n_steps or s.measure_speedup_prompts <= c.rollout.prompts_per_step,
             "speculation.measure_speedup_prompts",
             f"is {s.measure_speedup_prompts}; the sample comes from the step's rollout.prompts_per_step="
             f"{c.rollout.prompts_per_step} prompts: give at most that many")
    if s.mode == "bandit":
        _require(len(b.arms) >= 1 and len(set(b.arms)) == len(b.arms), "speculation.bandit.arms",
                 f"{list(b.arms)} must list one or more distinct k values, e.g. [1, 2, 3]")
        _require(all(0 <= k <= d.num_speculative_tokens for k in b.arms), "speculation.bandit.arms",
                 f"{list(b.arms)} must be in 0..draft.num_speculative_tokens={d.num_speculative_tokens} "
                 f"(the engine's k_max)")
    if s.long_tail.enabled:
        _require(d.mode == "cotrained", "speculation.long_tail.enabled", f"spot training trains the draft, but "
                 f"draft.mode={d.mode}; set draft.mode=cotrained or disable the long tail")
        _require(par.dp * par.cp * par.pp == 1, "speculation.long_tail.enabled",
                 "spot training runs on the rollout process only; use it with parallel.dp=cp=pp=1")


def _check_sync(c: SpecTrainConfig) -> None:
    s = c.sync
    _one_of(s.on_dead, "sync.on_dead", OnDead)
    _require(0 < s.collapse_ratio < 1, "sync.collapse_ratio", f"is {s.collapse_ratio}; it must be in (0, 1)")
    _one_of(s.on_mismatch, "sync.on_mismatch", OnMismatch)
    for key in ("logprob_tolerance", "weight_rtol"):
        value = getattr(c.sync, key)
        _require(value is None or value > 0, f"sync.{key}",
                 f"is {value}; it must be > 0 (or null for the dtype's default)")


def _check_trainer(c: SpecTrainConfig) -> None:
    t = c.trainer
    _one_of(t.accelerator, "trainer.accelerator", Accelerator)
    _one_of(t.resume, "trainer.resume", Resume)
    logger_names(t.logger)
    _require(t.keep_checkpoints >= -1, "trainer.keep_checkpoints",
             f"is {t.keep_checkpoints}; give how many step checkpoints to keep: 0 (only last.ckpt), N, or -1 (all)")
    _require(t.save_top_k >= 0, "trainer.save_top_k",
             f"is {t.save_top_k}; give how many best checkpoints to keep: N >= 1, or 0 for none")
    _one_of(t.save_top_k_metric, "trainer.save_top_k_metric", TopKMetric)
    _one_of(t.save_top_k_mode, "trainer.save_top_k_mode", TopKMode)
    if t.save_top_k:
        _require(c.eval.every_n_steps >= 1, "trainer.save_top_k", "ranks checkpoints by the held-out evaluation, "
                 "but eval.every_n_steps=0 never evaluates during training; set eval.every_n_steps=N "
                 "(the candidates' cadence) or trainer.save_top_k=0")
    _require(t.export_every_n_steps >= 0, "trainer.export_every_n_steps",
             f"is {t.export_every_n_steps}; give N >= 1 to export every N steps, or 0 for only the final export")
    _require(t.keep_exports == -1 or t.keep_exports >= 1, "trainer.keep_exports",
             f"is {t.keep_exports}; give how many exports to keep: N >= 1, or -1 (all)")
    _require(0 <= t.seed <= _MAX_SEED, "trainer.seed", f"is {t.seed}; it must be in 0..{_MAX_SEED}")
    _require(t.warmstart_dir is None or Path(t.warmstart_dir).resolve() != Path(t.run_dir).resolve(),
             "trainer.warmstart_dir", "is the run directory itself; use a directory of its own, or null for "
             "<run_dir>/warmstart")
    for i, callback in enumerate(t.callbacks):
        _require("." in callback.target, f"trainer.callbacks[{i}].target",
                 f"'{callback.target}' must be the full import path of a lightning Callback class, "
                 f"e.g. my_pkg.callbacks.MyCallback")


TOP_K_METRICS = get_args(TopKMetric)
LOGGERS = ("csv", "tensorboard", "wandb", "mlflow", "console")


def logger_names(value) -> list[str]:
    """`trainer.logger` as a list of distinct logger names (a single name is a list of one; `console` is a
    no-op: the progress bar is the console). Raises a ConfigError naming a bad entry."""
    names = [value] if isinstance(value, str) else value
    _require(isinstance(names, Sequence) and not isinstance(names, bytes)
             and all(isinstance(n, str) for n in names), "trainer.logger",
             f"{value!r} must be a logger name or a list of them, one or more of {list(LOGGERS)}, e.g. "
             f"trainer.logger=csv or trainer.logger=[csv,wandb]")
    for n in names:
        where = "" if isinstance(value, str) else f" (in {list(names)})"
        _require(n in LOGGERS, "trainer.logger", f"'{n}'{where} is not one of {list(LOGGERS)}; e.g. "
                 f"trainer.logger=csv or trainer.logger=[csv,wandb]")
    _require(len(set(names)) == len(names), "trainer.logger", f"{list(names)} names a logger twice; list each once")
    return [n for n in names if n != "console"]


def _paths(files) -> list[str]:
    return [files] if isinstance(files, str) else list(files or [])


def _warn_val_in_train(c: SpecTrainConfig) -> None:
    """Held-out prompts that are training prompts measure memorisation, not generalisation."""
    train = {Path(f).resolve() for f in _paths(c.data.train_files)}
    shared = [f for f in _paths(c.data.val_files) if Path(f).resolve() in train]
    if shared:
        warn_input(f"data.val_files: {', '.join(shared)} {'is' if len(shared) == 1 else 'are'} also in "
                   f"data.train_files: the held-out curve is measured on training prompts (as with "
                   f"data.val_files=null); give a file of prompts the run does not train on")


def _warn_filter_without_limit(c: SpecTrainConfig) -> None:
    if not c.data.filter_overlong_prompts and c.data.max_prompt_length is None:
        warn_input("data.filter_overlong_prompts=false does nothing without data.max_prompt_length: it refuses "
                   "files with prompts longer than that limit, and there is none (a prompt too long for the engine "
                   "is refused by rollout.max_model_len either way); set data.max_prompt_length=N, or drop the key")


def _warn_draft_without_speculation(c: SpecTrainConfig) -> None:
    """A warning, not a refusal: co-training can be debugged on the torch engine."""
    if c.rollout.engine == "torch" and c.draft.mode != "none":
        trained = ", though it is still trained" if c.draft.mode == "cotrained" else ""
        warn_input(f"draft.mode={c.draft.mode} with rollout.engine=torch: the torch engine never speculates, so the "
                   f"draft never drafts{trained}; set draft.mode=none, or rollout.engine=vllm to speculate with it")


def _warn_lr_warmup_past_run(c: SpecTrainConfig) -> None:
    """`lr_lambda` trains step s (from 1) at (s - 1) / lr_warmup_steps of grpo.lr: a warm-up as long as the run or
    longer never reaches grpo.lr (a run resumed with a larger trainer.max_steps may, hence a warning)."""
    g, steps = c.grpo, c.trainer.max_steps
    if not 0 < steps <= g.lr_warmup_steps:
        return
    ramp = ("stays at 0 for the whole run" if steps == 1 else f"ramps from 0 at step 1 and reaches only "
            f"{100 * (steps - 1) / g.lr_warmup_steps:.2g}% of grpo.lr={g.lr:g} by the last step")
    decay = "" if g.lr_scheduler == "constant" else f", and grpo.lr_scheduler={g.lr_scheduler} never decays"
    example = f"e.g. {steps // 10}, or 0 for none" if steps >= 10 else "e.g. 0: no warm-up"
    warn_input(f"grpo.lr_warmup_steps={g.lr_warmup_steps} is not shorter than the run (trainer.max_steps={steps}): "
               f"the policy's lr {ramp}{decay}; set grpo.lr_warmup_steps below trainer.max_steps ({example}), or "
               f"raise trainer.max_steps")


def validate(c: SpecTrainConfig) -> None:
    """Reject impossible values before any work starts, then warn about accepted ones that would not do what they
    look like; every message names the key and the fix."""
    _check_ranges(c)
    for check in (_check_policy, _check_task, _check_reward, _check_rollout, _check_grpo, _check_draft, _check_parallel,
                  _check_speculation, _check_sync, _check_trainer):
        check(c)
    for warn in (_warn_val_in_train, _warn_filter_without_limit, _warn_draft_without_speculation,
                 _warn_lr_warmup_past_run):
        warn(c)

"""Keys spectrain does not read, refused at load time in one line that names the key to use instead.

`RENAMED_KEYS`: spectrain's own keys under an earlier name (no migration: the old name is refused). `VERL_KEYS` and
`NEMO_RL_KEYS`: the other frameworks' keys that docs/glossary.md maps, with the spectrain key of the same (or the
closest) setting; any other key under a section only they have (`FOREIGN_SECTIONS`) is refused as theirs too.
"""
from __future__ import annotations

_TOY = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "qk_norm", "tie_word_embeddings", "max_position_embeddings")

RENAMED_KEYS = {
    "rollout.group_size": "rollout.n",
    "rollout.max_new_tokens": "rollout.response_length",
    "grpo.kl_beta": "grpo.kl_loss_coef",
    "grpo.kl_estimator": "grpo.kl_loss_type",
    "grpo.clip_eps": "grpo.clip_ratio",
    "grpo.clip_eps_low": "grpo.clip_ratio_low",
    "grpo.clip_eps_high": "grpo.clip_ratio_high",
    "grpo.norm_adv_by_std": "grpo.norm_adv_by_std_in_grpo",
    "grpo.epochs": "grpo.ppo_epochs",
    "trainer.eval_every_n_steps": "eval.every_n_steps",
    "rollout.eval_prompts": "eval.prompts",
    "rollout.eval_samples": "eval.samples",
    "draft.check_alive": "sync.check_alive",
    "draft.on_dead": "sync.on_dead",
    "draft.collapse_ratio": "sync.collapse_ratio",
    "task.digits": "toy.digits",
    "task.operands": "toy.operands",
    **{f"policy.{key}": f"toy.{key}" for key in _TOY},
}

_ARR = "actor_rollout_ref"
VERL_KEYS = {
    f"{_ARR}.rollout.n": "rollout.n",
    "data.train_batch_size": "rollout.prompts_per_step",
    "data.max_response_length": "rollout.response_length",
    f"{_ARR}.rollout.response_length": "rollout.response_length",
    f"{_ARR}.rollout.temperature": "rollout.temperature",
    f"{_ARR}.rollout.top_p": "rollout.top_p",
    f"{_ARR}.rollout.max_model_len": "rollout.max_model_len",
    f"{_ARR}.rollout.dtype": "rollout.dtype",
    f"{_ARR}.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    f"{_ARR}.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    f"{_ARR}.rollout.enforce_eager": "rollout.enforce_eager",
    f"{_ARR}.rollout.enable_prefix_caching": "rollout.enable_prefix_caching",
    f"{_ARR}.rollout.free_cache_engine": "rollout.enable_sleep_mode",
    f"{_ARR}.rollout.name": "rollout.engine",
    f"{_ARR}.rollout.engine_kwargs": "rollout.vllm_kwargs",
    f"{_ARR}.rollout.val_kwargs.n": "eval.samples",
    "data.val_max_samples": "eval.prompts",
    f"{_ARR}.actor.optim.lr": "grpo.lr",
    f"{_ARR}.actor.optim.clip_grad": "grpo.grad_clip",
    f"{_ARR}.actor.grad_clip": "grpo.grad_clip",
    f"{_ARR}.actor.optim.weight_decay": "grpo.weight_decay",
    f"{_ARR}.actor.optim.lr_warmup_steps": "grpo.lr_warmup_steps",
    f"{_ARR}.actor.optim.lr_scheduler_type": "grpo.lr_scheduler",
    f"{_ARR}.actor.optim.warmup_style": "grpo.lr_scheduler",
    f"{_ARR}.actor.clip_ratio": "grpo.clip_ratio",
    f"{_ARR}.actor.clip_ratio_low": "grpo.clip_ratio_low",
    f"{_ARR}.actor.clip_ratio_high": "grpo.clip_ratio_high",
    f"{_ARR}.actor.kl_loss_coef": "grpo.kl_loss_coef",
    f"{_ARR}.actor.use_kl_loss": "grpo.kl_loss_coef",
    f"{_ARR}.actor.kl_loss_type": "grpo.kl_loss_type",
    f"{_ARR}.actor.loss_agg_mode": "grpo.loss_agg_mode",
    f"{_ARR}.actor.ppo_epochs": "grpo.ppo_epochs",
    f"{_ARR}.actor.ppo_mini_batch_size": "grpo.minibatches",
    f"{_ARR}.actor.ppo_max_token_len_per_gpu": "grpo.micro_batch_tokens",
    f"{_ARR}.actor.use_dynamic_bsz": "grpo.micro_batch_tokens",
    f"{_ARR}.actor.strategy": "parallel.fsdp",
    f"{_ARR}.actor.ulysses_sequence_parallel_size": "parallel.cp",
    f"{_ARR}.actor.megatron.pipeline_model_parallel_size": "parallel.pp",
    f"{_ARR}.actor.fsdp_config.dtype": "policy.dtype",
    f"{_ARR}.ref.fsdp_config.model_dtype": "grpo.reference_dtype",
    f"{_ARR}.actor.checkpoint.save_contents": "trainer.export_every_n_steps",
    f"{_ARR}.model.path": "policy.path",
    f"{_ARR}.model.tokenizer_path": "tokenizer.path",
    f"{_ARR}.model.custom_chat_template": "tokenizer.chat_template",
    f"{_ARR}.model.enable_gradient_checkpointing": "policy.activation_checkpointing",
    f"{_ARR}.model.override_config.attn_implementation": "policy.attention_backend",
    f"{_ARR}.model.mtp.enable_train": "draft.mode",
    f"{_ARR}.model.mtp.num_speculative_tokens": "draft.num_speculative_tokens",
    "data.apply_chat_template_kwargs": "tokenizer.chat_template_kwargs",
    "data.response_key": "data.target_key",
    "data.seed": "trainer.seed",
    "reward_model.ground_truth": "data.answer_key",
    "reward_model.overlong_buffer.enable": "grpo.overlong_buffer_len",
    "reward_model.overlong_buffer.len": "grpo.overlong_buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "grpo.overlong_penalty_factor",
    "custom_reward_function.path": "reward.path",
    "custom_reward_function.name": "reward.function",
    "algorithm.norm_adv_by_std_in_grpo": "grpo.norm_adv_by_std_in_grpo",
    "algorithm.filter_groups": "grpo.dynamic_sampling",
    "algorithm.kl_ctrl": "grpo.kl_loss_coef",  # spectrain's KL term is in the loss (verl's use_kl_loss)
    "algorithm.use_kl_in_reward": "grpo.kl_loss_coef",
    "algorithm.kl_penalty": "grpo.kl_loss_type",
    "algorithm.adv_estimator": "grpo.norm_adv_by_std_in_grpo",  # GRPO; false: Dr. GRPO
    "trainer.n_gpus_per_node": "parallel.dp",
    "trainer.nnodes": "parallel.dp",
    "trainer.device": "trainer.accelerator",
    "trainer.total_training_steps": "trainer.max_steps",
    "trainer.total_epochs": "trainer.max_steps",
    "trainer.test_freq": "eval.every_n_steps",
    "trainer.val_before_train": "eval.every_n_steps",
    "trainer.save_freq": "trainer.checkpoint_every_n_steps",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_checkpoints",
    "trainer.default_local_dir": "trainer.run_dir",
    "trainer.log_val_generations": "trainer.log_samples_n",
    "trainer.resume_mode": "trainer.resume",
}

NEMO_RL_KEYS = {
    "grpo.num_generations_per_prompt": "rollout.n",
    "grpo.num_prompts_per_step": "rollout.prompts_per_step",
    "grpo.max_val_samples": "eval.prompts",
    "grpo.val_batch_size": "eval.prompts",
    "grpo.val_num_generations_per_prompt": "eval.samples",
    "grpo.val_period": "eval.every_n_steps",
    "grpo.val_at_start": "eval.every_n_steps",
    "grpo.max_num_steps": "trainer.max_steps",
    "grpo.seed": "trainer.seed",
    "grpo.normalize_rewards": "grpo.norm_adv_by_std_in_grpo",
    "policy.model_name": "policy.path",
    "policy.precision": "policy.dtype",
    "policy.tokenizer.name": "tokenizer.path",
    "policy.tokenizer.chat_template": "tokenizer.chat_template",
    "policy.tokenizer.chat_template_kwargs": "tokenizer.chat_template_kwargs",
    "policy.train_global_batch_size": "grpo.minibatches",
    "policy.train_micro_batch_size": "grpo.micro_batch_tokens",
    "policy.dynamic_batching": "grpo.micro_batch_tokens",
    "policy.max_total_sequence_length": "rollout.max_model_len",
    "policy.max_grad_norm": "grpo.grad_clip",
    "policy.optimizer.kwargs.lr": "grpo.lr",
    "policy.optimizer.kwargs.weight_decay": "grpo.weight_decay",
    "policy.scheduler": "grpo.lr_scheduler",
    "policy.generation.max_new_tokens": "rollout.response_length",
    "policy.generation.temperature": "rollout.temperature",
    "policy.generation.top_p": "rollout.top_p",
    "policy.generation.backend": "rollout.engine",
    "policy.generation.colocated": "rollout.engine_ranks",
    "policy.generation.vllm_cfg.max_model_len": "rollout.max_model_len",
    "policy.generation.vllm_cfg.precision": "rollout.dtype",
    "policy.generation.vllm_cfg.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "policy.generation.vllm_cfg.tensor_parallel_size": "rollout.tensor_parallel_size",
    "policy.generation.vllm_cfg.enforce_eager": "rollout.enforce_eager",
    "policy.generation.vllm_kwargs.speculative_config": "draft.num_speculative_tokens",
    "policy.generation.vllm_kwargs": "rollout.vllm_kwargs",
    "policy.dtensor_cfg.enabled": "parallel.fsdp",
    "policy.dtensor_cfg.context_parallel_size": "parallel.cp",
    "policy.dtensor_cfg.activation_checkpointing": "policy.activation_checkpointing",
    "policy.activation_checkpointing_enabled": "policy.activation_checkpointing",
    "policy.dtensor_cfg": "parallel.fsdp",
    "policy.megatron_cfg.pipeline_model_parallel_size": "parallel.pp",
    "policy.draft.enabled": "draft.mode",
    "policy.draft.model_name": "draft.path",
    "policy.draft.aux_layer_indices": "draft.tap_layers",
    "loss_fn.ratio_clip_min": "grpo.clip_ratio_low",
    "loss_fn.ratio_clip_max": "grpo.clip_ratio_high",
    "loss_fn.reference_policy_kl_penalty": "grpo.kl_loss_coef",
    "loss_fn.token_level_loss": "grpo.loss_agg_mode",
    "data.train.data_path": "data.train_files",
    "data.train.dataset_name": "task.name",
    "data.validation.data_path": "data.val_files",
    "data.default.input_key": "data.prompt_key",
    "data.default.output_key": "data.answer_key",
    "data.default.prompt_file": "data.prompt_template",
    "data.default.system_prompt_file": "tokenizer.system_prompt",
    "data.default.env_name": "reward.name",
    "data.max_input_seq_length": "data.max_prompt_length",
    "cluster.gpus_per_node": "parallel.dp",
    "cluster.num_nodes": "parallel.dp",
    "checkpointing.enabled": "trainer.checkpoint_every_n_steps",
    "checkpointing.save_period": "trainer.checkpoint_every_n_steps",
    "checkpointing.checkpoint_dir": "trainer.run_dir",
    "checkpointing.keep_top_k": "trainer.save_top_k",
    "checkpointing.metric_name": "trainer.save_top_k_metric",
    "checkpointing.higher_is_better": "trainer.save_top_k_mode",
    "logger.wandb_enabled": "trainer.logger",
    "logger.mlflow_enabled": "trainer.logger",
    "logger.tensorboard_enabled": "trainer.logger",
    "logger.wandb.project": "trainer.project_name",
    "logger.wandb.name": "trainer.experiment_name",
    "logger.num_val_samples_to_print": "trainer.log_samples_n",
    "logger.log_dir": "trainer.run_dir",
}

# top-level sections that only verl or NeMo-RL have: a key under one is theirs even when no table above names it
FOREIGN_SECTIONS = {"actor_rollout_ref": "verl", "algorithm": "verl", "critic": "verl", "reward_model": "verl",
                    "custom_reward_function": "verl", "ray_init": "verl", "loss_fn": "NeMo-RL", "cluster": "NeMo-RL",
                    "checkpointing": "NeMo-RL", "logger": "NeMo-RL", "env": "NeMo-RL"}


def refusal(key: str) -> str | None:
    """Why `key` (a dotted path spectrain's schema lacks) is refused, naming the key to use; None: not a known
    name (the caller's generic unknown-key message applies). The longest known prefix of `key` decides."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in RENAMED_KEYS:
            return (f"'{key}' is spectrain's old name for '{RENAMED_KEYS[prefix]}' (renamed; old names are not read): "
                    f"use {RENAMED_KEYS[prefix]}")
        for framework, table in (("verl", VERL_KEYS), ("NeMo-RL", NEMO_RL_KEYS)):
            if prefix in table:
                return (f"'{key}' is {framework}'s key; spectrain's is '{table[prefix]}' (docs/glossary.md maps "
                        f"{framework}'s keys): use {table[prefix]}")
    if parts[0] in FOREIGN_SECTIONS:
        framework = FOREIGN_SECTIONS[parts[0]]
        return (f"'{key}' is a {framework} key spectrain has no equivalent of under that name; docs/glossary.md maps "
                f"{framework}'s keys to spectrain's (`spectrain show-config` prints every key)")
    return None

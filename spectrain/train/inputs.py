"""What a run trains on, built from the config: tokenizer, prompt sources, reward and the policy.

The toy world (character tokenizer, arithmetic task, a policy built from scratch) is the
default; `policy.path`, `tokenizer.path`, `data.*` and `reward.*` swap in a Hugging Face
checkpoint, its tokenizer, prompt files and another reward (docs/your_model.md). Every
failure here is a `ConfigError` naming the key to fix, raised before anything is written.
"""
from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch

from spectrain.config import SpecTrainConfig
from spectrain.errors import ConfigError, warn_input
from spectrain.machine import resolve_device
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM


def build_tokenizer(config: SpecTrainConfig):
    """The checkpoint's own tokenizer (`tokenizer.path`, else `policy.path`), or the toy's character tokenizer."""
    t = config.tokenizer
    path = t.path or config.policy.path
    if path is None:
        from spectrain.tasks.tokenizer import CharTokenizer

        return CharTokenizer()
    from spectrain.tasks.hf_tokenizer import HFTokenizer, TokenizerLoadError

    try:
        return HFTokenizer(path, chat_template=t.chat_template, chat_template_kwargs=dict(t.chat_template_kwargs),
                           system_prompt=t.system_prompt)
    except TokenizerLoadError as exc:  # names the file; the key that gave the directory is known here
        fix = ("restore it, or point tokenizer.path at another tokenizer directory" if t.path else
               "restore it (e.g. copy the checkpoint again), or set tokenizer.path to the tokenizer it was trained "
               "with")
        raise ConfigError(f"{'tokenizer.path' if t.path else 'policy.path'}: {exc}; {fix}") from exc
    except ValueError as exc:  # the message names its tokenizer.* key
        raise ConfigError(str(exc)) from exc


def file_prompts(config: SpecTrainConfig, files, tokenizer, key: str):
    """The rows of `files` (`data.train_files` or `data.val_files`, named by `key` in errors)."""
    from spectrain.tasks.sources import PromptFileError, build_prompt_source

    d = config.data
    try:
        return build_prompt_source("files", files=files, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                   target_key=d.target_key, prompt_template=d.prompt_template,
                                   max_prompt_length=d.max_prompt_length,
                                   filter_overlong_prompts=d.filter_overlong_prompts, on_bad_row=d.on_bad_row,
                                   tokenizer=tokenizer, seed=config.trainer.seed)
    except PromptFileError as exc:
        raise ConfigError(f"{key}: {exc}") from exc
    except ValueError as exc:  # the tokenizer refusing a prompt (e.g. chat messages without a chat template)
        raise ConfigError(f"{exc} (while reading {key})") from exc
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {files} ({exc.strerror or exc}); give the path of a .jsonl, "
                          f".json or .parquet prompt file (or a list of them)") from exc


def build_reward_fn(config: SpecTrainConfig):
    """`reward.name` bound to its options; a custom reward that does not import fails here."""
    from spectrain.tasks.rewards import get_reward_fn

    r = config.reward
    options: dict[str, dict[str, object]] = {
        "exact_answer": dict(partial_credit=r.partial_credit),
        "custom": dict(path=r.path, function=r.function, timeout_s=r.timeout_s)}
    try:
        return get_reward_fn(r.name, **options.get(r.name, {}))
    except ValueError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("reward.") else f"reward.name: {message}") from exc


def model_identity(config: SpecTrainConfig) -> dict | None:
    """What names a pretrained policy in cache keys: its resolved path and a hash of its config.json."""
    if config.policy.path is None:
        return None
    path = Path(config.policy.path).resolve()
    digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    return {"path": str(path), "config_sha256": digest}


def check_policy_path(config: SpecTrainConfig) -> LlamaConfig | None:
    """The checkpoint's architecture, and its weights scanned for NaN/inf (streamed, see `check_finite`), to fail
    early on a bad `policy.path`."""
    if config.policy.path is None:
        return None
    from spectrain.models.hf_io import check_finite, load_config, safetensors_tensors, weight_files

    try:
        pretrained = load_config(config.policy.path)
        for file in weight_files(Path(config.policy.path)):
            check_finite("policy.path", file, safetensors_tensors(file))
        return pretrained
    except (OSError, ValueError) as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("policy.path") else f"policy.path: {message}") from exc


def build_policy(config: SpecTrainConfig, tokenizer) -> LlamaForCausalLM:
    """The pretrained `policy.path` (float32 master weights), or the toy policy sized by `toy.*`."""
    p = config.toy
    if config.policy.path is None:
        cfg = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=p.hidden_size,
                          intermediate_size=p.intermediate_size, num_hidden_layers=p.num_hidden_layers,
                          num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_key_value_heads,
                          qk_norm=p.qk_norm, tie_word_embeddings=p.tie_word_embeddings,
                          max_position_embeddings=p.max_position_embeddings, bos_token_id=tokenizer.bos_id,
                          eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        return LlamaForCausalLM(cfg)
    from spectrain.models.hf_io import load_pretrained

    # bf16 runs autocast over float32 master weights
    policy = load_pretrained(config.policy.path, dtype=torch.float32)  # its errors name policy.path
    check_vocab(config, policy.cfg.vocab_size, tokenizer.vocab_size)
    return policy


def _attention_half_dtype(config: SpecTrainConfig) -> torch.dtype | None:
    """What the 16-bit attention kernels compute a bf16 run's float32 q/k/v in (None: a float32 run)."""
    return torch.bfloat16 if config.policy.dtype == "bfloat16" else None


def attention_backend(config: SpecTrainConfig) -> dict[str, str]:
    """`policy.attention_backend` checked for the trainer's device at start-up (a backend that cannot run there
    is a ConfigError now, not at the first step), and what it runs there (`auto` resolved)."""
    from spectrain.ops.backends import check_attention_backend

    name, device = config.policy.attention_backend, resolve_device(config.trainer.accelerator).type
    return {"configured": name, "device": device,
            "resolved": check_attention_backend(name, device, _attention_half_dtype(config))}


def check_draft_loss_kernel(config: SpecTrainConfig) -> str | None:
    """`draft.loss_kernel` checked for the trainer's device at start-up; what runs there (`auto` resolved; None
    without a draft)."""
    from spectrain.ops.draft_loss import resolve_loss_kernel

    if config.draft.mode == "none":
        return None  # no draft, no draft loss: whatever kernel is named never runs
    return resolve_loss_kernel(config.draft.loss_kernel, resolve_device(config.trainer.accelerator))


DRAFT_VOCAB_COVERAGE = 0.9  # a draft vocabulary that holds fewer of the train completions' tokens is warned about


def check_draft_vocab(config: SpecTrainConfig, model_vocab: int, source, tokenizer) -> None:
    """`draft.draft_vocab_size` against the train completions the warm start picks it from
    (`completion_token_ids`): refused where it cannot be built, warned about where it covers too few of their
    tokens (the draft never proposes the others, so they bound acceptance)."""
    from spectrain.tasks.draft_vocab import (
        completion_token_ids,
        coverage,
        size_for_coverage,
        token_counts,
        vocab_mapping_from_counts,
    )

    d = config.draft
    if d.mode == "none" or d.init == "path" or d.draft_vocab_size is None or d.draft_vocab_size == model_vocab:
        return  # no draft, the checkpoint's own vocabulary, or the whole vocabulary
    if d.draft_vocab_size > model_vocab:
        raise ConfigError(f"draft.draft_vocab_size: is {d.draft_vocab_size}, more than the policy's {model_vocab} "
                          f"tokens; give at most {model_vocab}, or null for the whole vocabulary")
    counts = token_counts(completion_token_ids(source, tokenizer), model_vocab)
    try:
        _, t2d = vocab_mapping_from_counts(counts, d.draft_vocab_size, tokenizer.stop_ids)
    except ValueError as exc:
        raise ConfigError(f"draft.draft_vocab_size: {exc}") from exc
    covered = coverage(counts, t2d)
    if covered < DRAFT_VOCAB_COVERAGE:
        enough = size_for_coverage(counts, DRAFT_VOCAB_COVERAGE, tokenizer.stop_ids)
        warn_input(f"draft.draft_vocab_size={d.draft_vocab_size} covers only {covered:.1%} of the train "
                   f"completions' tokens: the draft can never propose the other {1 - covered:.1%}, so acceptance is "
                   f"bounded; raise it ({enough} ids cover {DRAFT_VOCAB_COVERAGE:.0%}), or set it to null for the "
                   f"policy's whole vocabulary")


def policy_attention_ops(config: SpecTrainConfig):
    """The ops object of `policy.attention_backend`: the policy's attention and its draft's TTT trunk."""
    from spectrain.ops.backends import build_attention_ops

    return build_attention_ops(config.policy.attention_backend, _attention_half_dtype(config))


def check_vocab(config: SpecTrainConfig, model_vocab: int, tokenizer_vocab: int) -> None:
    """A model may pad its vocabulary beyond the tokenizer's (ids it never sees), never the other way round. The fix
    depends on who brought the tokenizer: `tokenizer.path`, or the checkpoint itself."""
    if tokenizer_vocab <= model_vocab:
        return
    crash = "ids beyond the model's embedding would crash the forward"
    if config.tokenizer.path is not None:
        raise ConfigError(f"tokenizer.path: the tokenizer has {tokenizer_vocab} tokens but the policy's vocab_size is "
                          f"{model_vocab}: {crash}. Use the checkpoint's own tokenizer (tokenizer.path=null) or one "
                          f"it was trained with")
    assert config.policy.path is not None  # without tokenizer.path, the tokenizer is the checkpoint's own
    raise ConfigError(f"policy.path: the checkpoint's own tokenizer has {tokenizer_vocab} tokens but its config.json "
                      f"says vocab_size={model_vocab}: {crash}, so the checkpoint is inconsistent. Fix vocab_size in "
                      f"{Path(config.policy.path) / 'config.json'}, or set tokenizer.path to the tokenizer the model "
                      f"was trained with")


def check_context(config: SpecTrainConfig, pretrained: LlamaConfig) -> None:
    """The engine's context must fit the checkpoint's positions (the toy's is checked against policy.*)."""
    if config.rollout.max_model_len > pretrained.max_position_embeddings:
        raise ConfigError(f"rollout.max_model_len: {config.rollout.max_model_len} exceeds the checkpoint's "
                          f"max_position_embeddings={pretrained.max_position_embeddings}; lower rollout.max_model_len")


def policy_architecture(config: SpecTrainConfig) -> LlamaConfig:
    """`policy.path`'s config.json (no weights are read), or the toy policy `toy.*` would build."""
    p = config.toy
    if config.policy.path is not None:
        from spectrain.models.hf_config import load_config

        return load_config(config.policy.path)
    return LlamaConfig(vocab_size=build_tokenizer(config).vocab_size, hidden_size=p.hidden_size,
                       intermediate_size=p.intermediate_size, num_hidden_layers=p.num_hidden_layers,
                       num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_key_value_heads,
                       qk_norm=p.qk_norm, tie_word_embeddings=p.tie_word_embeddings,
                       max_position_embeddings=p.max_position_embeddings)


def check_draft_path(config: SpecTrainConfig, pretrained: LlamaConfig | None) -> None:
    """`draft.path`'s config read and checked against the policy (the pretrained one, or the toy `policy.*` builds);
    its weights scanned for NaN/inf (they load in the warm start)."""
    d = config.draft
    if d.mode == "none" or d.init != "path":
        return
    assert d.path is not None  # validated: draft.init=path needs draft.path
    from spectrain.models.eagle3 import check_draft_weights, read_draft_config

    with warnings.catch_warnings():  # a missing eagle_config is reported once, when the draft loads
        warnings.simplefilter("ignore")
        try:
            read_draft_config(d.path, pretrained if pretrained is not None else policy_architecture(config))
            check_draft_weights(d.path)
        except OSError as exc:
            raise ConfigError(f"draft.path: cannot read {d.path} ({exc}); give an EAGLE-3 directory in vLLM's or "
                              f"SpecForge's layout") from exc

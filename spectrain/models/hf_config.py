"""A Hugging Face checkpoint's `config.json` as a `LlamaConfig`, or an error saying why not.

The architecture is read through `transformers.AutoConfig`, so every spelling transformers
accepts works (`rope_scaling` or `rope_parameters`, `rope_theta` inside or beside them,
implicit `head_dim`). Anything this model would compute differently from transformers or
vLLM is refused with the feature named: never silently different numerics.
"""
from __future__ import annotations

import json
from pathlib import Path

from spectrain.errors import ConfigError
from spectrain.models.llama import ARCHITECTURES, ROPE_TYPES, LlamaConfig

_SUPPORTED = "LlamaForCausalLM (llama), Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM (qwen3, dense)"
# rope_type -> the fields `rope_frequencies` reads besides rope_type (the others are optional)
_ROPE_REQUIRED = {"default": (), "linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "yarn": ("factor", "original_max_position_embeddings")}
_ROPE_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")}
# the model's size: transformers fills an absent one with its class default (an 8B-sized model), never the checkpoint's
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_raw_config(model_dir: str | Path) -> dict:
    """`config.json` as written, after checking the directory looks like a checkpoint."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        what = "holds no config.json" if path.is_dir() else "is not a directory"
        raise ConfigError(f"policy.path: {path} {what}; point policy.path at a local Hugging Face checkpoint "
                          "(config.json and *.safetensors; `spectrain plan` reads only its config.json), or null for "
                          "the toy policy")
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"policy.path: {path}/config.json is not valid JSON ({exc}); fix or re-download it") from exc


def load_config(model_dir: str | Path) -> LlamaConfig:
    """The policy architecture of the checkpoint in `model_dir` (raw config and directory kept)."""
    path = Path(model_dir)
    raw = read_raw_config(path)
    model_type = _check_architecture(path, raw)
    missing = [key for key in _REQUIRED if raw.get(key) is None]
    if missing:
        raise ConfigError(f"policy.path: {path}/config.json lacks {', '.join(missing)}; use the config.json the "
                          "checkpoint was released with, which sets the model's size")
    from transformers import AutoConfig  # heavy import, only for pretrained policies

    hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    _check_features(path, hf, model_type)
    rope = dict(hf.rope_parameters or {})
    llama_bias = model_type == "llama" and bool(hf.attention_bias)
    return LlamaConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=hf.rms_norm_eps, rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=hf.max_position_embeddings, tie_word_embeddings=bool(hf.tie_word_embeddings),
        qk_norm=model_type == "qwen3", bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id,
        pad_token_id=_fill_token_id(hf), initializer_range=hf.initializer_range,
        attention_bias=model_type == "qwen2" or llama_bias, o_proj_bias=llama_bias,
        rope_scaling=_rope_scaling(path, rope, hf.max_position_embeddings), model_type=model_type,
        hf_config=raw, source_dir=str(path.resolve()),
    )


def _check_architecture(path: Path, raw: dict) -> str:
    model_type, architectures = raw.get("model_type"), raw.get("architectures")
    if model_type not in ARCHITECTURES or architectures not in (None, [ARCHITECTURES[model_type]]):
        raise ConfigError(f"policy.path: {path} holds architecture {architectures} (model_type {model_type!r}), "
                          f"which spectrain does not implement; supported: {_SUPPORTED}. Use a checkpoint of "
                          "one of these families")
    return model_type


def _check_features(path: Path, hf, model_type: str) -> None:
    """Refuse options that this model (or vLLM) would compute differently from transformers."""
    unsupported = []
    if hf.hidden_act != "silu":
        unsupported.append(f"hidden_act={hf.hidden_act!r} (only silu)")
    if getattr(hf, "mlp_bias", False):
        unsupported.append("mlp_bias=true")
    if model_type == "qwen3" and hf.attention_bias:
        unsupported.append("attention_bias=true on qwen3 (transformers and vLLM disagree on the o_proj bias)")
    if getattr(hf, "use_sliding_window", False) or any(
            t != "full_attention" for t in getattr(hf, "layer_types", None) or ()):
        unsupported.append("sliding-window attention (use_sliding_window / layer_types)")
    rope = hf.rope_parameters or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported.append(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    if unsupported:
        raise ConfigError(f"policy.path: {path}/config.json uses {'; '.join(unsupported)}, which spectrain does not "
                          "implement (its logits would differ from transformers and vLLM). Use a checkpoint "
                          "without these options")


def _rope_scaling(path: Path, rope: dict, max_position_embeddings: int) -> dict | None:
    """transformers' standardised rope parameters reduced to `LlamaConfig.rope_scaling`."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"policy.path: {path}/config.json has rope type {rope_type!r}, which spectrain does not "
                          f"implement; supported rope types: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return None
    params = {k: rope[k] for k in _ROPE_REQUIRED[rope_type] + _ROPE_OPTIONAL.get(rope_type, ()) if k in rope}
    if rope_type == "yarn" and params.get("factor") is None and "original_max_position_embeddings" in params:
        params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]  # as transformers
    missing = [k for k in _ROPE_REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise ConfigError(f"policy.path: {path}/config.json: rope type {rope_type!r} needs {missing} in "
                          "rope_scaling / rope_parameters; add them as the model's release specifies")
    return {"rope_type": rope_type, **params}


def _fill_token_id(hf) -> int:
    """An id to pad shards with (never attended to or scored): the checkpoint's pad, else its eos, else 0."""
    for candidate in (hf.pad_token_id, hf.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if isinstance(candidate, int):
            return candidate
    return 0

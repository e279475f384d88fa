"""Save and load the policy as a Hugging Face directory that vLLM loads directly."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spectrain.models.llama import LlamaConfig, LlamaForCausalLM

_WEIGHTS = "model.safetensors"


def hf_config_dict(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The `config.json` HF and vLLM expect for this architecture."""
    fields = dataclasses.asdict(cfg)
    fields.pop("qk_norm")
    return {
        **fields,
        "architectures": [cfg.architecture],
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def state_dict_for_export(model: LlamaForCausalLM, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF-named, contiguous copies (tied heads are stored once, as HF does)."""
    tensors = {}
    for name, p in model.state_dict().items():
        if model.cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        tensors[name] = p.detach().to(dtype).contiguous().clone()
    return tensors


def save_pretrained(model: LlamaForCausalLM, out_dir: str | Path, tokenizer=None,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write `config.json`, `model.safetensors` and (optionally) the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.cfg, dtype), indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": model.cfg.bos_token_id, "eos_token_id": model.cfg.eos_token_id,
         "pad_token_id": model.cfg.pad_token_id}, indent=2))
    save_file(state_dict_for_export(model, dtype), str(out / _WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_config(model_dir: str | Path) -> LlamaConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a policy directory needs config.json and {_WEIGHTS}")
    raw = json.loads(path.read_text())
    names = {f.name for f in dataclasses.fields(LlamaConfig)}
    kwargs = {k: v for k, v in raw.items() if k in names}
    kwargs["qk_norm"] = raw.get("model_type") == "qwen3"
    return LlamaConfig(**kwargs)


def load_pretrained(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    cfg = load_config(model_dir)
    model = LlamaForCausalLM(cfg)
    state = load_file(str(Path(model_dir) / _WEIGHTS))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match the config "
                         f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})")
    return model.to(dtype)

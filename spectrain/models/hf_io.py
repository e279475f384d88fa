"""Save and load the policy as a Hugging Face directory that vLLM loads directly.

Loading builds the model on the meta device and fills it from the safetensors file(s) one
shard at a time, straight into the target dtype and device: an 8B checkpoint never exists
as a float32 random init. Saving writes a checkpoint's own `config.json` back (only the
dtype updated), so vLLM serves exactly the architecture the user gave.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spectrain.errors import ConfigError
from spectrain.models.hf_config import load_config
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["check_finite", "hf_config_dict", "load_config", "load_pretrained", "safetensors_tensors", "save_pretrained",
           "state_dict_for_export"]

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_GENERATION_CONFIG = "generation_config.json"
_TORCH_WEIGHTS = ("*.bin", "*.pt", "*.pth")
# LlamaConfig fields that are not config.json keys of the same meaning
_INTERNAL_FIELDS = ("qk_norm", "model_type", "hf_config", "source_dir", "attention_bias", "o_proj_bias",
                    "rope_scaling")
_MAX_LISTED = 10  # weight problems named in one error


def hf_config_dict(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The `config.json` HF and vLLM expect: a checkpoint's own (dtype updated), or the toy policy's."""
    dtype_name = str(dtype).removeprefix("torch.")
    if cfg.hf_config is not None:
        written = {k: dtype_name for k in ("torch_dtype", "dtype") if k in cfg.hf_config} or {"torch_dtype": dtype_name}
        return {**cfg.hf_config, **written}
    if cfg.attention_bias or cfg.o_proj_bias or cfg.rope_scaling:
        raise ValueError("only a config read from a checkpoint (hf_config set) can carry attention biases or "
                         "rope scaling: the toy policy's config.json has neither")
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _INTERNAL_FIELDS}
    return {
        **fields,
        "architectures": [cfg.architecture],
        "model_type": cfg.model_type,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype_name,
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
    """Write `config.json`, `generation_config.json`, `model.safetensors` and (optionally) the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.cfg, dtype), indent=2))
    _write_generation_config(model.cfg, out)
    save_file(state_dict_for_export(model, dtype), str(out / _WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _write_generation_config(cfg: LlamaConfig, out: Path) -> None:
    """The checkpoint's own generation config (its stop ids and sampling defaults), else the toy's ids."""
    source = Path(cfg.source_dir) / _GENERATION_CONFIG if cfg.source_dir else None
    if source is not None and source.is_file():
        if source.resolve() != (out / _GENERATION_CONFIG).resolve():
            shutil.copyfile(source, out / _GENERATION_CONFIG)
    elif cfg.hf_config is None:
        (out / _GENERATION_CONFIG).write_text(json.dumps(
            {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
             "pad_token_id": cfg.pad_token_id}, indent=2))


def load_pretrained(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """The checkpoint in `model_dir` in `dtype` on `device`, built without a random init.

    A tied head needs no `lm_head.weight` in the file; one that is there is ignored, as
    transformers and vLLM ignore it.
    """
    path = Path(model_dir)
    cfg = load_config(path)
    shards = weight_files(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    ignored = set()
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]
        ignored.add("lm_head.weight")
    stored, problems = set(), []
    for shard in shards:
        part, shard_problems, names = _read_shard(shard, expected, ignored, dtype, device)
        model.load_state_dict(part, strict=False, assign=True)
        stored.update(names)
        problems += shard_problems
    problems += [f"{name} missing" for name in sorted(set(expected) - stored)]
    if problems:
        raise ConfigError(f"policy.path: {path}: the weights do not match config.json ({_listed(problems)}); "
                          "point policy.path at a complete checkpoint whose config.json describes its weights")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign=True replaced the shared Parameter
    return model


def read_tensor(model_dir: str | Path, name: str) -> torch.Tensor:
    """One tensor of a checkpoint, read from the file that holds it (e.g. the embedding a draft trained for this
    checkpoint copied, to compare with after SFT moved the policy's)."""
    for shard in weight_files(Path(model_dir)):
        with safe_open(str(shard), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise ConfigError(f"policy.path: {model_dir} holds no tensor {name}")


def safetensors_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each `(name, tensor)` of one safetensors file, read one at a time: memory holds the largest tensor only."""
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def check_finite(key: str, file: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse the first floating-point tensor with NaN/inf entries, naming `key`, the file and the tensor.

    A corrupt checkpoint would otherwise train to NaN and fail the first weight sync, far from its
    cause. The scan streams: memory holds one tensor, never the model. Its cost is one more read
    of the whole checkpoint before the warm start loads it: a blink for the tiny recipes, about
    1 s per GiB on two CPU cores once read (8B: tens of seconds; 70B: minutes, mostly the disk).
    """
    try:
        for name, tensor in tensors:
            # ids and masks (a draft's d2t / t2d) cannot be NaN; a NaN or inf entry always makes the sum non-finite,
            # so a finite sum (no mask allocated) clears the tensor, and only a suspect one is counted exactly
            if not tensor.is_floating_point() or torch.isfinite(tensor.sum(dtype=torch.float32)):
                continue
            finite = torch.isfinite(tensor if tensor.element_size() > 1 else tensor.half())  # no isfinite for float8
            if bad := finite.numel() - int(finite.sum()):  # 0: finite entries whose float32 sum overflowed
                raise ConfigError(f"{key}: {file}: {name} has {bad} NaN/inf entries; the checkpoint is corrupt: "
                                  "re-download or re-export it")
    except SafetensorError as exc:
        raise ConfigError(f"{key}: {file} cannot be read ({exc}); the file is truncated or corrupt: re-download or "
                          "re-export it") from exc


def _read_shard(shard: Path, expected: dict[str, tuple[int, ...]], ignored: set[str], dtype: torch.dtype,
                device: str | torch.device) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """One file's usable tensors in `dtype` on `device`, what is wrong with the others, and all its names."""
    tensors, problems = {}, []
    with safe_open(str(shard), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            if name in ignored:
                continue
            if name not in expected:
                problems.append(f"{name} unexpected")
                continue
            shape = tuple(f.get_slice(name).get_shape())
            if shape != expected[name]:
                problems.append(f"{name} is {shape}, config.json needs {expected[name]}")
                continue
            tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return tensors, problems, names


def _listed(problems: list[str]) -> str:
    """The first few problems and how many more: a wrong checkpoint can have hundreds."""
    more = len(problems) - _MAX_LISTED
    return "; ".join(problems[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights: the index's shards, or the single file."""
    if (path / _INDEX).is_file():
        weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
        shards = [path / name for name in sorted(set(weight_map.values()))]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise ConfigError(f"policy.path: {path}/{_INDEX} lists shards that are not there: {absent}; "
                              "finish the download or copy the missing files")
        return shards
    if (path / _WEIGHTS).is_file():
        return [path / _WEIGHTS]
    if any(next(path.glob(pattern), None) for pattern in _TORCH_WEIGHTS):
        raise ConfigError(f"policy.path: {path} has PyTorch pickle weights (*.bin / *.pt) but no *.safetensors; "
                          "convert them to safetensors (e.g. load with transformers and save_pretrained(..., "
                          "safe_serialization=True))")
    raise ConfigError(f"policy.path: {path} is not a Hugging Face model directory (needs config.json and "
                      f"*.safetensors: {_WEIGHTS} or {_INDEX} with its shards)")

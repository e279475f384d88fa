"""The `hf_tiny_cpu` recipe's assets: the bring-your-own-model path, small enough for a CPU.

A user brings a Hugging Face checkpoint, a GSM8K-style dataset and maybe an EAGLE-3 draft
trained with SpecForge. This module writes one of each, in exactly those formats, so that
the whole path (AutoConfig/AutoTokenizer loading, chat template, `####` answers scored by
`math_verify`, a SpecForge draft with a reduced vocabulary) runs in minutes on a laptop:

- `train.jsonl` / `val.jsonl`: one- and two-step word problems with small integers, rows
  `{"question": ..., "answer": "<worked solution>\\n#### 42"}` as in GSM8K;
- `policy/`: a random Qwen3 checkpoint saved by `transformers` (safetensors,
  `generation_config.json` with `<|im_end|>` among the stop ids) with a byte-level BPE
  tokenizer and a ChatML template;
- `draft/`: an EAGLE-3 draft in SpecForge's layout (config.json without `eagle_config`,
  `d2t`/`t2d` from the train answers' token frequencies, the target's frozen embedding).

Everything is seeded and written once per `VERSION` under the cache root.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spectrain.tasks.draft_vocab import vocab_mapping_from_token_ids
from spectrain.tasks.hf_tokenizer import build_chatml_bpe_tokenizer

VERSION = "v1"  # bump when anything written here changes: old caches are then ignored
SEED = 0
TRAIN_ROWS, VAL_ROWS = 2000, 200
TOKENIZER_VOCAB = 512
DRAFT_VOCAB = 256
POLICY: dict[str, Any] = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=384, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
_DONE = "DONE"


@dataclass(frozen=True)
class HFTinyAssets:
    policy_dir: Path  # Qwen3 checkpoint + tokenizer files
    train_file: Path
    val_file: Path
    draft_dir: Path  # EAGLE-3 draft, SpecForge layout


def _paths(root: Path) -> HFTinyAssets:
    return HFTinyAssets(root / "policy", root / "train.jsonl", root / "val.jsonl", root / "draft")


def write_hf_tiny_assets(root: str | Path) -> HFTinyAssets:
    """The assets under `root/VERSION`, written on the first call only.

    They are built in a scratch directory next to it and renamed into place, so an
    interrupted or concurrent writer never leaves a half-written set behind.
    """
    final = Path(root) / VERSION
    if (final / _DONE).is_file():
        return _paths(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=final.parent))
    try:
        _write_all(_paths(scratch))
        (scratch / _DONE).write_text(VERSION + "\n")
        try:
            os.rename(scratch, final)
        except OSError:
            if not (final / _DONE).is_file():  # not a concurrent writer that finished first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _paths(final)


def _write_all(assets: HFTinyAssets) -> None:
    rows = word_problems(TRAIN_ROWS + VAL_ROWS, SEED)
    train, val = rows[:TRAIN_ROWS], rows[TRAIN_ROWS:]
    write_jsonl(assets.train_file, train)
    write_jsonl(assets.val_file, val)
    build_chatml_bpe_tokenizer([r["question"] + "\n" + r["answer"] for r in train], TOKENIZER_VOCAB,
                               assets.policy_dir)
    tokenizer = write_random_qwen3(assets.policy_dir, SEED)
    stop_and_special = tokenizer.all_special_ids
    d2t, t2d = vocab_mapping_from_token_ids(
        (tokenizer.encode(r["answer"], add_special_tokens=False) for r in train),
        _config(assets.policy_dir)["vocab_size"], DRAFT_VOCAB, always_include=stop_and_special)
    write_specforge_draft(assets.draft_dir, assets.policy_dir, d2t, t2d, SEED)


# data -------------------------------------------------------------------------------------
_NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ian", "Jo", "Kai", "Lena", "Max", "Nora",
          "Omar", "Pia", "Raj", "Sara", "Tom", "Uma"]
_ITEMS = ["apples", "books", "coins", "pens", "stamps", "shells", "cards", "eggs", "marbles", "stickers"]


def _add(r: random.Random, name: str, item: str) -> tuple[str, str, int]:
    a, b = r.randint(2, 30), r.randint(2, 30)
    return (f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?",
            f"{name} has {a} + {b} = {a + b} {item} now.", a + b)


def _subtract(r: random.Random, name: str, item: str) -> tuple[str, str, int]:
    b = r.randint(1, 20)
    a = b + r.randint(1, 20)
    return (f"{name} had {a} {item} and gave {b} of them away. How many {item} are left?",
            f"{a} - {b} = {a - b} {item} are left.", a - b)


def _multiply(r: random.Random, name: str, item: str) -> tuple[str, str, int]:
    a, b = r.randint(2, 9), r.randint(2, 9)
    return (f"A bag holds {a} {item}. {name} has {b} bags. How many {item} does {name} have?",
            f"{b} bags of {a} {item} make {b} * {a} = {a * b} {item}.", a * b)


def _divide(r: random.Random, name: str, item: str) -> tuple[str, str, int]:
    each, friends = r.randint(2, 9), r.randint(2, 6)
    total = each * friends
    return (f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?",
            f"Each friend gets {total} / {friends} = {each} {item}.", each)


def _add_then_subtract(r: random.Random, name: str, item: str) -> tuple[str, str, int]:
    a, b = r.randint(2, 20), r.randint(2, 20)
    c = r.randint(1, a + b - 1)
    return (f"{name} has {a} {item}, buys {b} more and then gives {c} to a friend. "
            f"How many {item} does {name} have left?",
            f"After buying, {name} has {a} + {b} = {a + b} {item}.\n"
            f"After giving some away, {name} has {a + b} - {c} = {a + b - c} {item}.", a + b - c)


_TEMPLATES: list[Callable[[random.Random, str, str], tuple[str, str, int]]] = [
    _add, _subtract, _multiply, _divide, _add_then_subtract]


def word_problems(n: int, seed: int) -> list[dict]:
    """`n` distinct GSM8K-format rows: `question`, and `answer` ending in `#### <integer>`."""
    r = random.Random(seed)
    rows: list[dict] = []
    seen: set[str] = set()
    while len(rows) < n:
        question, solution, result = r.choice(_TEMPLATES)(r, r.choice(_NAMES), r.choice(_ITEMS))
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": f"{solution}\n#### {result}"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# models -----------------------------------------------------------------------------------
def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def write_random_qwen3(policy_dir: Path, seed: int):
    """A random Qwen3 (`POLICY` sizes) next to the tokenizer in `policy_dir`; returns the tokenizer.

    As in Qwen3's release: the vocabulary is the tokenizer's padded to a multiple of 64,
    `<|endoftext|>` is BOS and pad, and generation stops at `<|im_end|>` or `<|endoftext|>`.
    """
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    end_of_turn, end_of_text = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    ids: dict[str, Any] = dict(bos_token_id=end_of_text, eos_token_id=end_of_turn, pad_token_id=end_of_text)
    config = Qwen3Config(vocab_size=-(-len(tokenizer) // 64) * 64, **POLICY, **ids)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(**{**ids, "eos_token_id": [end_of_turn, end_of_text]})
    model.save_pretrained(policy_dir)
    return tokenizer


def write_specforge_draft(draft_dir: Path, target_dir: Path, d2t: torch.Tensor, t2d: torch.Tensor,
                          seed: int) -> Path:
    """A random EAGLE-3 draft for the checkpoint in `target_dir`, laid out as SpecForge exports one.

    config.json as SpecForge's `configs/qwen3-*-eagle3.json` (no `eagle_config`: the aux
    layers are the serving engine's default); weights `midlayer.*`, `fc`, `norm`, `lm_head`
    over the draft vocabulary, `d2t`/`t2d`, and the target's embedding copied in as
    `embed_tokens.weight` (SpecForge's export ships the frozen embedding).
    """
    target = _config(target_dir)
    h, inter, vocab = target["hidden_size"], target["intermediate_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or h // heads
    rope_theta = (target.get("rope_parameters") or {}).get("rope_theta", target.get("rope_theta", 10000.0))
    draft_vocab = d2t.numel()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": target.get("bos_token_id"), "eos_token_id": target.get("eos_token_id"),
        "head_dim": head_dim, "hidden_act": "silu", "hidden_size": h, "initializer_range": 0.02,
        "intermediate_size": inter, "max_position_embeddings": target["max_position_embeddings"],
        "model_type": "llama", "num_attention_heads": heads, "num_hidden_layers": 1,
        "num_key_value_heads": kv_heads, "rms_norm_eps": target["rms_norm_eps"], "rope_scaling": None,
        "rope_theta": rope_theta, "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab,
    }
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * config["initializer_range"]

    tensors = {
        "fc.weight": normal(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": normal(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": normal(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": normal(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": normal(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": normal(inter, h),
        "midlayer.mlp.up_proj.weight": normal(inter, h),
        "midlayer.mlp.down_proj.weight": normal(h, inter),
        **{f"midlayer.{n}.weight": torch.ones(h) for n in ("input_layernorm", "hidden_norm",
                                                           "post_attention_layernorm")},
        "norm.weight": torch.ones(h),
        "lm_head.weight": normal(draft_vocab, h),
        "d2t": d2t.long(),
        "t2d": t2d.bool(),
        "embed_tokens.weight": _target_embeddings(target_dir).float(),
    }
    draft_dir.mkdir(parents=True, exist_ok=True)
    (draft_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(draft_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return draft_dir


def _target_embeddings(target_dir: Path) -> torch.Tensor:
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")

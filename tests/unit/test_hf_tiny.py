"""The hf_tiny_cpu assets: written once, and each readable by what reads a user's own files
(transformers for the checkpoint and tokenizer, JSON for GSM8K rows, `load_draft` for SpecForge)."""
import json
import operator
import re

import pytest
import torch
from safetensors.torch import load_file

from spectrain.models.eagle3 import load_draft
from spectrain.models.hf_io import load_config
from spectrain.tasks.hf_tiny import DRAFT_VOCAB, TRAIN_ROWS, VAL_ROWS, VERSION, word_problems, write_hf_tiny_assets

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_hf_tiny_assets(tmp_path_factory.mktemp("cache"))


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_written_once(assets):
    root = assets.policy_dir.parent
    assert root.name == VERSION and (root / "DONE").is_file()
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    assert write_hf_tiny_assets(root.parent) == assets
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == stamps
    assert [p.name for p in root.parent.iterdir()] == [VERSION], "no scratch directory left behind"


def test_gsm8k_rows_are_correct_and_seeded(assets):
    train, val = _rows(assets.train_file), _rows(assets.val_file)
    assert (len(train), len(val)) == (TRAIN_ROWS, VAL_ROWS)
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    assert train[:5] == word_problems(5, 0) and word_problems(5, 1) != word_problems(5, 0)
    for row in train + val:
        solution, final = row["answer"].rsplit("\n#### ", 1)
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", solution)
        assert steps, row
        for a, op, b, c in steps:  # every worked step is right, and the last one is the answer
            assert OPS[op](int(a), int(b)) == int(c), row
        assert int(final) == int(steps[-1][3]), row


def test_policy_and_tokenizer_load_in_transformers(assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(assets.policy_dir)
    model = AutoModelForCausalLM.from_pretrained(assets.policy_dir)
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == ("qwen3", 128, 4, 32)
    assert cfg.vocab_size % 64 == 0 and 0 <= cfg.vocab_size - len(tokenizer) < 64 and not cfg.tie_word_embeddings
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in GenerationConfig.from_pretrained(assets.policy_dir).eos_token_id
    for row in _rows(assets.val_file)[:50]:
        for text in row.values():
            assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2 + 3?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    assert prompt[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    logits = model(torch.tensor([prompt])).logits
    assert logits.shape == (1, len(prompt), cfg.vocab_size) and torch.isfinite(logits).all()


def test_specforge_draft_loads_for_the_policy(assets):
    from transformers import AutoTokenizer

    config = json.loads((assets.draft_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "eagle_config" not in config
    policy_cfg = load_config(assets.policy_dir)
    embeddings = load_file(str(assets.policy_dir / "model.safetensors"))["model.embed_tokens.weight"]
    with pytest.warns(UserWarning, match="default aux layers"):
        draft = load_draft(assets.draft_dir, policy_cfg=policy_cfg, policy_embeddings=embeddings)
    assert draft.cfg.draft_vocab_size == DRAFT_VOCAB < draft.cfg.vocab_size == policy_cfg.vocab_size
    tokenizer = AutoTokenizer.from_pretrained(assets.policy_dir)
    kept = set(torch.nonzero(draft.t2d).flatten().tolist())
    assert set(tokenizer.all_special_ids) <= kept  # the stop ids, however rare
    answer_ids = [t for r in _rows(assets.train_file)[:200] for t in tokenizer.encode(r["answer"])]
    assert sum(t in kept for t in answer_ids) / len(answer_ids) > 0.95  # the frequent answer tokens

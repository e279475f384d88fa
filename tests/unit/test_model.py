"""The policy model: packing, taps, GQA/qk-norm variants and the HF save/load round trip."""
import json

import pytest
import torch

from spectrain.models.eagle3 import default_tap_layers
from spectrain.models.hf_io import load_pretrained, save_pretrained
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM, pack_sequences

CFG = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(params=[{}, {"qk_norm": True}, {"tie_word_embeddings": True}], ids=["llama", "qwen3", "tied"])
def model(request):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CFG, **request.param)).double()


def test_packed_equals_separate(model):
    seqs = [[1, 5, 9, 3], [1, 7], [1, 2, 3, 4, 5, 6]]
    ids, pos, cu = pack_sequences(seqs)
    packed = model(ids, pos, cu).logits
    for i, s in enumerate(seqs):
        alone = model(*pack_sequences([s])).logits
        assert torch.allclose(packed[cu[i]:cu[i + 1]], alone, atol=1e-12)


def test_taps_are_residual_entering_layers(model):
    ids, pos, cu = pack_sequences([[1, 5, 9, 3, 4]])
    out = model(ids, pos, cu, tap_layers=(0, 2))
    assert torch.equal(out.tap_hidden[0], out.embeds)
    x = out.embeds
    cos_sin = __import__("spectrain.models.llama", fromlist=["rope_cos_sin"]).rope_cos_sin(
        pos, model.cfg.head_dim, model.cfg.rope_theta, x.dtype)
    for i in range(2):
        x = model.model.layers[str(i)](x, *cos_sin, cu, model.attention_ops)
    assert torch.allclose(out.tap_hidden[1], x, atol=1e-12)


def test_capture_of_missing_layer_is_a_clear_error(model):
    with pytest.raises(ValueError, match="aux layer ids \\[9\\]"):
        model(*pack_sequences([[1, 2]]), tap_layers=(9,))


def test_default_aux_ids_match_vllm():
    assert default_tap_layers(32) == (2, 16, 29)
    assert default_tap_layers(4) == (1, 2, 3)  # (2, 2, 1) would name layer 2 twice


def test_save_load_round_trip(model, tmp_path):
    save_pretrained(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [model.cfg.architecture]
    loaded = load_pretrained(tmp_path, dtype=torch.float64)
    ids, pos, cu = pack_sequences([[1, 5, 9, 3]])
    assert torch.allclose(loaded(ids, pos, cu).logits, model(ids, pos, cu).logits, atol=1e-6)


def test_load_rejects_mismatched_weights(model, tmp_path):
    save_pretrained(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_pretrained(tmp_path)


def test_gqa_config_error():
    with pytest.raises(ValueError, match="multiple of"):
        LlamaConfig(num_attention_heads=4, num_key_value_heads=3)

"""The policy from a Hugging Face checkpoint: logits equal transformers' on checkpoints that
transformers itself writes (rope scaling, biases, qk-norm, tied heads, shards, padded vocab,
both config spellings), loaded without a random init, exported verbatim; bad inputs are clear errors."""
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from spectrain.errors import ConfigError
from spectrain.models.hf_io import load_config, load_pretrained, save_pretrained
from spectrain.models.llama import pack_sequences
from tests.helpers import write_hf_checkpoint

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
             "beta_slow": 1.0}
CASES = {  # name: (transformers config, save_pretrained kwargs)
    "llama3-rope-sharded": (transformers.LlamaConfig(**TINY, rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0}),
                            {"max_shard_size": "100KB"}),
    "llama-yarn-bias": (transformers.LlamaConfig(**TINY, attention_bias=True,
                                                 rope_parameters={**YARN_ROPE, "rope_theta": 10000.0}), {}),
    "qwen2-bias-padded-vocab": (transformers.Qwen2Config(**{**TINY, "vocab_size": 320}), {}),
    "qwen3-tied-head-dim": (transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True), {}),
}
SEQS = [[5, 17, 250, 3, 99, 42, 7, 280, 11, 64, 128, 1, 2, 200, 150, 31, 77, 8, 9, 10],
        [299, 4, 33, 180, 6, 12]]  # ids < 300: the padded rows of a 320-row vocab are never fed


def reference_logits(model, seqs):
    """transformers' logits, one sequence at a time, concatenated as a packed batch."""
    with torch.no_grad():
        return torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])


def packed_logits(policy, seqs):
    with torch.no_grad():
        return policy(*pack_sequences(seqs)).logits


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, transformers model) for every case."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (root / name, write_hf_checkpoint(root / name, config, **kwargs))
            for name, (config, kwargs) in CASES.items()}


def with_rope_scaling_spelling(path):
    """Rewrite config.json as older releases spell it (Llama-3.1's): `rope_scaling` plus a top-level `rope_theta`."""
    raw = json.loads((path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(checkpoints, name):
    path, reference = checkpoints[name]
    policy = load_pretrained(path)
    assert [policy.cfg.architecture] == json.loads((path / "config.json").read_text())["architectures"]
    diff = (packed_logits(policy, SEQS) - reference_logits(reference, SEQS)).abs().max().item()
    assert diff <= 1e-4, f"{name}: max |logits - transformers'| = {diff}"


def test_the_checkpoints_exercise_what_they_claim(checkpoints):
    """Each feature changes the logits here, so the parity above would catch it being ignored."""
    sharded, _ = checkpoints["llama3-rope-sharded"]
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    tied, _ = checkpoints["qwen3-tied-head-dim"]
    with safe_open(str(tied / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert load_config(tied).head_dim == 32 != 64 // 4
    for name in ("llama3-rope-sharded", "llama-yarn-bias"):
        policy = load_pretrained(checkpoints[name][0])
        scaled = packed_logits(policy, SEQS)
        policy.cfg.rope_scaling = None
        assert (packed_logits(policy, SEQS) - scaled).abs().max() > 1e-3, name
    qwen2 = load_pretrained(checkpoints["qwen2-bias-padded-vocab"][0])
    assert qwen2.cfg.vocab_size == 320 and qwen2.model.layers["0"].self_attn.q_proj.bias is not None
    assert qwen2.model.layers["0"].self_attn.o_proj.bias is None  # Qwen2: q/k/v biases only


def test_rope_scaling_spelling_gives_the_same_model(checkpoints, tmp_path):
    """`rope_scaling` + top-level `rope_theta` (older configs) reads as `rope_parameters` does."""
    config, _ = CASES["llama3-rope-sharded"]
    reference = write_hf_checkpoint(tmp_path, config, seed=1)
    with_rope_scaling_spelling(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_scaling"]["rope_type"] == "llama3"
    policy = load_pretrained(tmp_path)
    assert policy.cfg.rope_theta == 500000.0 and policy.cfg.rope_scaling == LLAMA3_ROPE
    assert (packed_logits(policy, SEQS) - reference_logits(reference, SEQS)).abs().max() <= 1e-4


def test_loads_the_file_without_random_init(checkpoints):
    """Built on the meta device: the RNG is never drawn from and every parameter is the file's, in the dtype asked."""
    path, _ = checkpoints["qwen2-bias-padded-vocab"]
    torch.manual_seed(0)
    expected_draw = torch.rand(4)
    torch.manual_seed(0)
    policy = load_pretrained(path, dtype=torch.bfloat16)
    assert torch.equal(torch.rand(4), expected_draw)
    stored = load_file(str(path / "model.safetensors"))
    params = dict(policy.named_parameters())
    assert set(params) == set(stored)
    for name, p in params.items():
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu" and p.requires_grad
        assert torch.equal(p.detach(), stored[name].to(torch.bfloat16)), name


def test_tied_head_in_the_file_is_ignored(checkpoints, tmp_path):
    """A tied checkpoint that also stores `lm_head.weight` loads as transformers and vLLM load it: tied."""
    path, reference = checkpoints["qwen3-tied-head-dim"]
    for f in ("config.json", "generation_config.json"):
        (tmp_path / f).write_text((path / f).read_text())
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])},
              str(tmp_path / "model.safetensors"))
    policy = load_pretrained(tmp_path)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    assert (packed_logits(policy, SEQS) - reference_logits(reference, SEQS)).abs().max() <= 1e-4


def test_export_writes_the_checkpoints_config_back(checkpoints, tmp_path):
    """save_pretrained keeps the user's config.json (dtype updated) and generation_config.json."""
    path, reference = checkpoints["llama-yarn-bias"]
    save_pretrained(load_pretrained(path), tmp_path, dtype=torch.bfloat16)
    source = json.loads((path / "config.json").read_text())
    assert json.loads((tmp_path / "config.json").read_text()) == {**source, "dtype": "bfloat16"}
    assert (tmp_path / "generation_config.json").read_text() == (path / "generation_config.json").read_text()
    exported = load_pretrained(tmp_path)
    assert exported.cfg.rope_scaling == load_config(path).rope_scaling
    bf16_error = (packed_logits(exported, SEQS) - reference_logits(reference, SEQS)).abs().max()
    assert 0 < bf16_error < 0.05  # rounded to bfloat16, not a different model


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **changes}))


@pytest.fixture
def llama_dir(tmp_path):
    write_hf_checkpoint(tmp_path / "llama", transformers.LlamaConfig(**TINY))
    return tmp_path / "llama"


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
     "architecture \\['MistralForCausalLM'\\] .*supported: LlamaForCausalLM \\(llama\\), Qwen2ForCausalLM"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "model_type 'qwen3_moe'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope type 'dynamic'.*supported rope types: default, linear, llama3, yarn"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=true"),
])
def test_unsupported_config_is_a_clear_error(llama_dir, changes, message):
    edit_config(llama_dir, **changes)
    with pytest.raises(ConfigError, match=f"policy.path: .*{message}"):
        load_pretrained(llama_dir)


def test_sliding_window_qwen2_is_refused(tmp_path):
    write_hf_checkpoint(tmp_path, transformers.Qwen2Config(**TINY))
    edit_config(tmp_path, use_sliding_window=True, max_window_layers=1, layer_types=None)
    with pytest.raises(ConfigError, match="sliding-window attention"):
        load_config(tmp_path)


def test_missing_directory_and_missing_weights(llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="policy.path: .*nope is not a directory; point policy.path at a local "
                                          "Hugging Face checkpoint \\(config.json and \\*.safetensors"):
        load_pretrained(tmp_path / "nope")
    (llama_dir / "model.safetensors").rename(llama_dir / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="no \\*.safetensors; convert them to safetensors"):
        load_pretrained(llama_dir)
    (llama_dir / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError, match="is not a Hugging Face model directory"):
        load_pretrained(llama_dir)


def test_weights_that_do_not_fit_the_config(llama_dir):
    tensors = load_file(str(llama_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    tensors["model.norm.weight"] = torch.ones(32)
    save_file(tensors, str(llama_dir / "model.safetensors"))
    with pytest.raises(ConfigError) as caught:
        load_pretrained(llama_dir)
    message = str(caught.value)
    assert "model.layers.0.self_attn.q_proj.bias unexpected" in message
    assert "model.norm.weight is (32,), config.json needs (64,)" in message
    assert "model.layers.1.mlp.up_proj.weight missing" in message

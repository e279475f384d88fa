"""End to end: `spectrain fit hf_tiny_cpu`, the bring-your-own-model path on CPU with real vLLM.

A Qwen3 checkpoint written by transformers, its BPE tokenizer with a ChatML template, GSM8K-format
files scored by math_verify and a draft started from a SpecForge-layout EAGLE-3 directory: the
same loop, logs and outputs the toy recipe gives.
"""
import json

import pytest
import torch

from spectrain.cli import main as cli_main
from tests.helpers import column, metrics

SHORT = ["trainer.max_steps=2", "eval.every_n_steps=0", "sft.steps=20", "draft.warmup_steps=5",
         "rollout.prompts_per_step=4", "rollout.n=4", "eval.prompts=8", "eval.samples=2",
         "rollout.response_length=32", "trainer.progress_bar=false"]


@pytest.fixture(scope="module")
def asset_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("spectrain_cache")


@pytest.mark.slow
@pytest.mark.vllm
def test_fit_hf_tiny_cpu_end_to_end(tmp_path, asset_cache, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(asset_cache))
    run_dir = tmp_path / "run"
    assert cli_main(["fit", "hf_tiny_cpu", f"trainer.run_dir={run_dir}", *SHORT]) == 0

    rows = metrics(run_dir)
    assert {int(r["step"]) for r in rows if r.get("policy/loss")} == {1, 2}
    assert all(0 <= r <= 1 for r in column(rows, "reward"))
    # the engine serves exactly the trainer's Qwen3 (qk-norm, untied head, padded vocab) after every sync
    assert all(0 < d < 1e-3 for d in column(rows, "policy/engine_logprob_diff"))
    assert column(rows, "sync/mismatches") == [0.0, 0.0]
    assert all(a >= 1 for a in column(rows, "spec/mean_acceptance_length"))
    assert all(loss == loss for loss in column(rows, "draft/loss"))  # the imported draft co-trains on finite losses

    config = json.loads((run_dir / "final/policy/config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    draft = json.loads((run_dir / "final/draft/config.json").read_text())
    assert draft["draft_vocab_size"] < draft["vocab_size"]  # the SpecForge draft's own reduced vocabulary is kept

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spectrain.models.hf_io import load_pretrained

    # the exported policy is a transformers checkpoint with the same logits as the trainer's model
    ids = AutoTokenizer.from_pretrained(run_dir / "final/policy")("Ada has 3 apples.")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(run_dir / "final/policy", dtype=torch.float32).eval()
    ours = load_pretrained(run_dir / "final/policy")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
        got = ours(torch.tensor(ids), torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32)).logits
    assert (got - expected).abs().max() < 1e-4


def test_hf_tiny_cpu_recipe_refuses_a_policy_path_that_is_no_checkpoint(tmp_path, asset_cache, monkeypatch, capsys):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(asset_cache))
    code = cli_main(["fit", "hf_tiny_cpu", f"trainer.run_dir={tmp_path / 'run'}", f"policy.path={tmp_path}"])
    assert code == 2
    assert "policy.path" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was written

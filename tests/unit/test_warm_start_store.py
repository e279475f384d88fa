"""The toy world's warm start is trained once per machine: a run in another directory with the same settings copies
the stored one; other settings, a `policy.path` checkpoint, or the store turned off train their own."""
import pytest
import torch

from spectrain.config import load_config
from spectrain.tasks.arithmetic import ArithmeticTask
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train import inputs
from spectrain.train.warm_start import (
    STORE_ENV,
    build_and_warm_up_draft,
    machine_store,
    policy_cache_key,
    warm_start_policy,
)

TINY = ["sft.steps=2", "sft.batch_size=4", "draft.warmup_steps=2"]


def warm_start(run_dir, *overrides):
    config = load_config("tiny_cpu", [*TINY, *overrides])
    tokenizer, task = CharTokenizer(), ArithmeticTask(config.toy.digits, config.toy.operands)
    policy, _ = warm_start_policy(config, inputs.build_policy(config, tokenizer), task, tokenizer, run_dir,
                                  progress=False)
    return policy, build_and_warm_up_draft(config, policy, task, tokenizer, run_dir / "draft_cache")


@pytest.fixture
def store_on(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(STORE_ENV, "1")
    return tmp_path / "cache" / "warmstart"


def test_a_second_run_copies_this_machines_warm_start(tmp_path, store_on, monkeypatch, capsys):
    first_policy, first_draft = warm_start(tmp_path / "a")
    assert len(list(store_on.iterdir())) == 2  # the policy and the draft, each under its settings' digest
    import spectrain.train.warm_start as ws

    monkeypatch.setattr(ws, "train_sft", lambda *a, **k: pytest.fail("trained the policy again"))
    monkeypatch.setattr(ws, "warm_up_draft", lambda *a, **k: pytest.fail("warmed the draft up again"))
    policy, draft = warm_start(tmp_path / "b")
    assert "this machine's copy with the same settings" in capsys.readouterr().out
    for theirs, ours in ((first_policy, policy), (first_draft, draft)):
        assert all(torch.equal(a, b) for a, b in zip(theirs.state_dict().values(), ours.state_dict().values()))
    assert (tmp_path / "b" / "meta.json").is_file() and (tmp_path / "b" / "draft_cache" / "draft").is_dir()


def test_other_settings_a_checkpoint_or_the_store_off_share_nothing(store_on, monkeypatch):
    def store(*overrides):
        config = load_config("tiny_cpu", [*TINY, *overrides])
        return machine_store(config, policy_cache_key(config))

    assert store() == store() and store() != store("sft.steps=3") and store().parent == store_on
    checkpoint = load_config("tiny_cpu", TINY)
    checkpoint.policy.path = "/ckpt"
    assert machine_store(checkpoint, {}) is None  # a checkpoint's weights are the user's to place
    monkeypatch.setenv(STORE_ENV, "0")
    assert store() is None

"""The warm start trains on the run's accelerator and hands back CPU models and a CPU optimizer state."""
import math

import pytest
import torch

from spectrain.config import load_config
from spectrain.tasks.arithmetic import ArithmeticTask
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train import inputs
from spectrain.train.warm_start import WARMUP_OPTIMIZER, build_and_warm_up_draft, warm_start_policy


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_warm_start_trains_on_the_accelerator_and_returns_cpu_models(tmp_path, accelerator):
    config = load_config("tiny_cpu", [f"trainer.accelerator={accelerator}", "sft.steps=3", "sft.batch_size=4",
                                      "draft.warmup_steps=2"])
    tokenizer, task = CharTokenizer(), ArithmeticTask(config.toy.digits, config.toy.operands)
    policy, meta = warm_start_policy(config, inputs.build_policy(config, tokenizer), task, tokenizer, tmp_path,
                                     progress=False)
    draft = build_and_warm_up_draft(config, policy, task, tokenizer, tmp_path)
    assert meta["steps"] == 3 and math.isfinite(meta["final_loss"])
    devices = {p.device.type for model in (policy, draft) for p in model.parameters()}
    assert devices == {"cpu"}, devices
    state = torch.load(tmp_path / "draft" / WARMUP_OPTIMIZER, weights_only=True)["state"]
    moments = [v for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert moments and {v.device.type for v in moments} == {"cpu"}

"""The flagship recipes' start on CPU: no SFT, no draft warm-up, a draft that does not predict the policy.

`qwen3_gsm8k` and `llama3_math` start with `sft.enabled: false`, `draft.warmup_steps: 0` and a scratch
(or imported) draft, so their first rollouts accept (almost) nothing. That is not a dead drafter: the
engine serves the synced draft. Each run here is `hf_tiny_cpu` in that shape for 3 GRPO steps, in
co-trained and frozen mode, with a scratch draft and the imported EAGLE-3 draft: it must finish, warn
once that the draft does not predict the policy, and keep speculating on every step.
"""
import json
import math
import warnings

import pytest

from spectrain.cli import main
from tests.helpers import column, metrics

STEPS = 3
COLD = ["sft.enabled=false", "draft.warmup_steps=0", "rollout.prompts_per_step=4", f"trainer.max_steps={STEPS}",
        "eval.prompts=4", "eval.samples=2", "eval.every_n_steps=0",
        "trainer.progress_bar=false"]
POOR_DRAFT = "the engine serves the synced draft"


@pytest.fixture(scope="module")
def asset_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("spectrain_cache")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("init,mode", [("scratch", "cotrained"), ("path", "frozen")])  # each init and mode once
def test_a_cold_draft_runs_and_is_warned_about_once(tmp_path, asset_cache, monkeypatch, mode, init):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(asset_cache))
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["fit", "hf_tiny_cpu", *COLD, f"draft.mode={mode}", f"draft.init={init}",
                     f"trainer.run_dir={run}"])
    assert code == 0
    poor = [str(w.message) for w in caught if POOR_DRAFT in str(w.message)]
    assert len(poor) == 1, poor  # once, however many steps it lasts
    assert ("draft.mode=frozen never trains it" in poor[0]) == (mode == "frozen"), poor[0]
    assert "does not predict this policy" in poor[0], poor[0]
    assert not [w for w in caught if "speculation is OFF" in str(w.message)]
    rows = metrics(run)
    acceptance = column(rows, "spec/mean_acceptance_length")
    assert len(acceptance) == STEPS and all(1.0 <= a <= 4.0 for a in acceptance), acceptance  # speculation stayed on
    if mode == "cotrained":
        losses = column(rows, "draft/loss")
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert json.loads((run / "spectrain_run.json").read_text())["result"]["steps"] == STEPS

"""End to end: `spectrain fit` on a shrunken default recipe with real vLLM, then resume."""
import json
import math

import pytest

from spectrain.cli import main as cli_main
from spectrain.config import ConfigError, load_config
from spectrain.errors import RunDirError
from spectrain.train.trainer import SpecTrainer
from tests.helpers import TINY, column, metrics


def untrained_draft_loss(run_dir, config) -> float:
    """The draft's TTT loss at its initialisation (one warm-up step at lr 0) on the warm-started policy."""
    from spectrain.models.hf_io import load_pretrained
    from spectrain.tasks.arithmetic import ArithmeticTask
    from spectrain.tasks.tokenizer import CharTokenizer
    from spectrain.train.draft_update import draft_optimizer
    from spectrain.train.warm_start import build_draft, warm_up_draft

    policy = load_pretrained(run_dir / "warmstart" / "policy")
    d, task = config.draft, ArithmeticTask(config.toy.digits, config.toy.operands)
    draft = build_draft(config, policy, task, CharTokenizer())
    [loss] = warm_up_draft(draft, policy, task, CharTokenizer(), steps=1, batch_size=config.sft.batch_size,
                           optimizer=draft_optimizer(draft, lr=0.0), ttt_passes=d.ttt_passes,
                           pass_decay=d.pass_decay, seed=0, progress=False)
    return loss


@pytest.mark.slow
def test_fit_runs_end_to_end_and_resumes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    probe = "speculation.measure_speedup_every_n_steps=2"  # on step 1 only; a resume may drop it
    assert cli_main(["fit", "tiny_cpu", f"trainer.run_dir={run_dir}", "trainer.max_steps=2", probe, *TINY]) == 0
    for path in ["config.yaml", "training.png", "acceptance_length.png", "final/policy/config.json",
                 "final/policy/model.safetensors", "final/policy/tokenizer.json", "final/draft/config.json",
                 "checkpoints/last.ckpt", "warmstart/meta.json", "warmstart/draft/meta.json"]:
        assert (run_dir / path).is_file(), path
    rows = metrics(run_dir)
    steps = {int(r["step"]) for r in rows if r.get("policy/loss")}
    assert steps == {1, 2} and "epoch" not in rows[0]  # counted from 1, as the plots and max_steps count
    rewards = column(rows, "reward")
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards), rewards
    acceptance = column(rows, "spec/mean_acceptance_length")
    assert len(acceptance) == 2 and all(a > 1 for a in acceptance), acceptance  # the synced draft is accepted
    # verified: the engine serves the policy
    assert all(0 < d < 1e-3 for d in column(rows, "policy/engine_logprob_diff"))
    assert column(rows, "sync/mismatches") == [0.0, 0.0]
    # 4 prompts x 4 samples fit the KV cache: none was preempted, and most decoded side by side (a
    # completion that ends on its first token leaves before the engine step that counts the peak)
    assert column(rows, "rollout/preemptions") == [0.0, 0.0]
    peaks = column(rows, "rollout/max_running")
    assert all(8 < running <= 16 for running in peaks), peaks
    # co-training steps ran on finite losses, below the untrained draft's (which is about ln(vocab) per pass)
    draft_losses = column(rows, "draft/loss")
    untrained = untrained_draft_loss(run_dir, load_config("tiny_cpu", [f"trainer.run_dir={run_dir}", *TINY]))
    assert len(draft_losses) == 2 and all(loss < untrained for loss in draft_losses), (draft_losses, untrained)
    last = next(r for r in rows if r.get("policy/kl") and int(r["step"]) == 2)
    assert float(last["policy/kl"]) > 0 and 0 <= float(last["policy/clip_fraction"]) <= 1
    summary = json.loads((run_dir / "spectrain_run.json").read_text())["result"]
    assert summary["steps"] == 2 and set(summary["final"]) == {"greedy_reward", "sampled_reward", "sampled_reward_se"}
    for when in ("warmstart", "final"):
        assert 0 <= summary[when]["greedy_reward"] <= 1 and 0 <= summary[when]["sampled_reward"] <= 1, summary
    assert summary["sampled_reward_gain_se"] == pytest.approx(
        math.hypot(summary["final"]["sampled_reward_se"], summary["warmstart"]["sampled_reward_se"]), abs=1e-4)
    held_out = [r for r in rows if r.get("eval/sampled_reward")]
    assert [int(r["step"]) for r in held_out] == [1, 2]  # after steps 1 and 2 (the warm start is step 0's)
    assert summary["final"]["sampled_reward"] == pytest.approx(float(held_out[-1]["eval/sampled_reward"]))
    captured = capsys.readouterr()
    assert_speed_reported(summary["speed"], rows, captured)
    # the whole run's time, phase by phase: the start-up's as well as the training loop's
    phases = summary["phases"]
    assert list(phases) == ["inputs", "sft", "draft_warmup", "engine_start", "warmstart_eval", "training", "final"]
    assert all(v >= 0 for v in phases.values()) and phases["sft"] > 0 and phases["training"] > 0
    assert sum(phases.values()) == pytest.approx(summary["seconds"], abs=0.5)
    assert "[spectrain] run time " in captured.err and ", SFT " in captured.err and ", engine start " in captured.err

    # Same command, more steps: resumes from the checkpoint instead of starting over.
    config = load_config("tiny_cpu", [f"trainer.run_dir={run_dir}", "trainer.max_steps=3", *TINY])
    result = SpecTrainer(config).fit()
    assert result.steps == 3
    assert {int(r["step"]) for r in metrics(run_dir) if r.get("policy/loss")} == {1, 2, 3}

    # A resume that changes what is trained is refused, and the run is left as it was.
    changed = load_config("tiny_cpu", [f"trainer.run_dir={run_dir}", "grpo.lr=1.0", *TINY])
    with pytest.raises(RunDirError, match="different config"):
        SpecTrainer(changed).fit()


def assert_speed_reported(speed: dict, rows: list[dict], captured) -> None:
    """The run's speed in its summary (spectrain_run.json, the printed JSON) and one line on stderr."""
    tokens = sum(t * s for t, s in zip(column(rows, "rollout/tokens_per_s"), column(rows, "rollout/seconds")))
    assert speed["generated_tokens"] == round(tokens) > 0 and speed["rollout_tokens_per_s"] > 0
    assert speed["mean_acceptance_length"] == pytest.approx(
        sum(column(rows, "spec/mean_acceptance_length")) / 2, abs=1e-3)
    probed = {key: column(rows, key) for key in ("spec/speedup_estimate", "spec/probe_tokens_per_s",
                                                 "spec/probe_plain_tokens_per_s", "time/speedup_probe")}
    assert all(len(v) == 2 and math.isnan(v[1]) for v in probed.values()), probed  # step 1 only; NaN on step 2
    estimate, rate, plain = (probed[k][0] for k in list(probed)[:3])
    assert estimate > 0 and speed["speedup_estimate"] == pytest.approx(estimate, abs=1e-3)
    assert rate == pytest.approx(estimate * plain, rel=1e-6)
    assert speed["seconds"]["rollout"] > 0 and speed["seconds"]["draft"] > 0 and speed["seconds"]["eval"] > 0
    assert speed["seconds"]["speedup_probe"] > 0 and sum(speed["share"].values()) == pytest.approx(1, abs=0.01)
    assert json.loads(captured.out[captured.out.index("{"):])["speed"] == speed
    assert "[spectrain] speed: rollout " in captured.err and " (probe); time: rollout " in captured.err


def test_existing_foreign_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    config = load_config("tiny_cpu", [f"trainer.run_dir={tmp_path}"])
    with pytest.raises(RunDirError, match="not a spectrain run directory"):
        SpecTrainer(config).fit()
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_existing_run_refused_with_resume_never(tmp_path):
    (tmp_path / "spectrain_run.json").write_text("{}")
    config = load_config("tiny_cpu", [f"trainer.run_dir={tmp_path}", "trainer.resume=never"])
    with pytest.raises(RunDirError, match="resume=never"):
        SpecTrainer(config).fit()


def test_prompt_too_long_for_engine_fails_before_work(tmp_path):
    config = load_config("tiny_cpu", [f"trainer.run_dir={tmp_path / 'r'}", "rollout.max_model_len=20"])
    with pytest.raises(ConfigError, match="rollout.max_model_len"):
        SpecTrainer(config).fit()
    assert not (tmp_path / "r").exists()  # checked before the run directory is created (tests/e2e/test_bad_inputs.py)


@pytest.mark.slow
def test_bf16_mixed_precision_keeps_float32_master_weights(tmp_path):
    import torch

    run_dir = tmp_path / "run"
    config = load_config("tiny_cpu", [f"trainer.run_dir={run_dir}", "trainer.max_steps=1", "policy.dtype=bfloat16",
                                      *TINY])
    trainer = SpecTrainer(config)
    trainer.fit()
    assert trainer.trainer.precision == "bf16-mixed"
    assert {p.dtype for p in trainer.module.policy.parameters()} == {torch.float32}
    adam = trainer.module.policy_optimizer().optimizer
    assert {s["exp_avg"].dtype for s in adam.state.values()} == {torch.float32}
    # the engine serves bf16 (vLLM's dtype follows policy.dtype): it agrees with the trainer to bf16's precision,
    # within the bf16 sync tolerance, and visibly less than float32's ~1e-7
    [diff] = column(metrics(run_dir), "policy/engine_logprob_diff")
    assert 1e-5 < diff < 5e-2, diff

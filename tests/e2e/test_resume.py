"""Kill-and-resume equals the uninterrupted run bit for bit; SIGTERM saves a checkpoint and says how to resume.

Real processes (the `spectrain` CLI in a subprocess), real vLLM, real signals.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.faults import KILL_ENV
from tests.helpers import logged_steps

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ARGS = ["sft.steps=20", "sft.batch_size=16", "draft.warmup_steps=10", "rollout.prompts_per_step=4",
        "rollout.n=4", "eval.prompts=4", "eval.samples=2", "eval.every_n_steps=2",
        "trainer.progress_bar=false", "trainer.checkpoint_every_n_steps=2", "grpo.minibatches=2",
        "trainer.max_steps=4", "trainer.callbacks=[{target: tests.faults.SignalAtStep}]"]


def fit(run_dir: Path, warmstart: Path, signal_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop(KILL_ENV, None)
    if signal_at:
        env[KILL_ENV] = signal_at
    return subprocess.run([sys.executable, "-m", "spectrain.cli", "fit", "tiny_cpu", f"trainer.run_dir={run_dir}",
                           f"trainer.warmstart_dir={warmstart}", *ARGS], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def weights(run_dir: Path) -> dict:
    return {**load_file(run_dir / "final/policy/model.safetensors"),
            **{f"draft.{k}": v for k, v in load_file(run_dir / "final/draft/model.safetensors").items()}}


def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(tmp_path):
    warmstart = tmp_path / "warmstart"
    reference = fit(tmp_path / "reference", warmstart)
    assert reference.returncode == 0, reference.stderr[-3000:]

    run = tmp_path / "run"
    stopped = fit(run, warmstart, signal_at="1:SIGTERM")  # a scheduler's SIGTERM during step 1
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "stopped by SIGTERM after 2 steps" in stopped.stderr and "same command again to resume" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert (run / "checkpoints/last.ckpt").is_file() and not (run / "final").exists()

    killed = fit(run, warmstart, signal_at="3:SIGKILL")  # a crash in step 3: the last checkpoint is after step 1
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = fit(run, warmstart)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, got = logged_steps(tmp_path / "reference"), logged_steps(run)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]  # steps counted from 1 (held-out rows at their step)
    assert got == expected  # every metric of every step, bit for bit (CSV holds the float's repr)
    assert float(got[3]["draft/loss"]) > 0 and float(got[3]["spec/mean_acceptance_length"]) > 1
    ref_weights, run_weights = weights(tmp_path / "reference"), weights(run)
    assert ref_weights.keys() == run_weights.keys()
    assert all((ref_weights[k] == run_weights[k]).all() for k in ref_weights)

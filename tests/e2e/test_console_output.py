"""`spectrain fit` as a user sees it in a log (not a terminal): spectrain's lines and one line per step; vLLM's,
Lightning's and torch's start-up noise only with `--verbose`; the CPU runtime it preloads changes no value."""
import os
import subprocess
import sys

import pytest

from tests.helpers import TINY, logged_steps

pytestmark = pytest.mark.slow
NOISE = ("WARNING", "GPU available", "TPU available", "Tip:", "Epoch 0", "v_num", "FutureWarning",
         "Loading safetensors")


def fit_output(run_dir, *extra: str, env_extra: dict | None = None) -> str:
    overrides = [o for o in TINY if o != "trainer.progress_bar=false"]  # the default: progress on
    command = [sys.executable, "-m", "spectrain", "fit", "tiny_cpu", f"trainer.run_dir={run_dir}", *overrides,
               "trainer.max_steps=2", "eval.every_n_steps=0", *extra]
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPECTRAIN_VERBOSE", "VLLM_LOGGING_LEVEL", "LD_PRELOAD", "SPECTRAIN_CPU_PRELOAD")}
    done = subprocess.run(command, capture_output=True, text=True, env={**env, **(env_extra or {})}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def quiet_fit(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("quiet") / "run"
    return run_dir, fit_output(run_dir)


def test_a_log_shows_spectrain_lines_and_one_line_per_step(quiet_fit):
    _, out = quiet_fit
    lines = out.splitlines()
    assert [line.split("  ")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert sum("[spectrain] vLLM runs on CPU" in line for line in lines) == 1
    assert any(line.startswith("[spectrain] warm-start SFT: 20 steps, loss ") for line in lines), out[-3000:]
    assert not [line for line in lines if any(n in line for n in NOISE)], out[-3000:]
    assert "\r" not in out  # no bar redraws in a log


def test_verbose_shows_the_hidden_noise_and_without_the_preload_every_value_is_the_same(quiet_fit, tmp_path):
    """One more fit serves both checks: `--verbose` with `SPECTRAIN_CPU_PRELOAD=0` (torch's GNU OpenMP) against
    the quiet fit, which ran with Intel OpenMP preloaded."""
    run_dir, out = quiet_fit
    assert "[spectrain] vLLM runs on CPU with libiomp5.so preloaded" in out, out[-3000:]  # and on a busy machine:
    assert ", as vLLM's CPU guide asks (SPECTRAIN_CPU_PRELOAD=0 turns it off)" in out  # KMP_BLOCKTIME=0 (load ...)
    plain = fit_output(tmp_path / "plain", "--verbose", env_extra={"SPECTRAIN_CPU_PRELOAD": "0"})
    assert "WARNING" in plain and "GPU available" in plain and "[spectrain] vLLM runs on CPU" not in plain
    assert "preloaded, as vLLM's CPU guide asks" not in plain
    preloaded, gnu_openmp = logged_steps(run_dir), logged_steps(tmp_path / "plain")
    assert len(preloaded) >= 2 and preloaded == gnu_openmp  # rewards, losses, acceptance: bit for bit

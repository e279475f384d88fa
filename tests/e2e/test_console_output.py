"""`spectrain fit` as a user sees it in a log (not a terminal): spectrain's lines and one line per step; vLLM's,
Lightning's and torch's start-up noise only with `--verbose`."""
import os
import subprocess
import sys

import pytest

from tests.helpers import TINY

pytestmark = pytest.mark.slow
NOISE = ("WARNING", "GPU available", "TPU available", "Tip:", "Epoch 0", "v_num", "FutureWarning",
         "Loading safetensors")


def fit_output(run_dir, *extra: str) -> str:
    overrides = [o for o in TINY if o != "trainer.progress_bar=false"]  # the default: progress on
    command = [sys.executable, "-m", "spectrain", "fit", "tiny_cpu", f"trainer.run_dir={run_dir}", *overrides,
               "trainer.max_steps=2", "trainer.eval_every_n_steps=0", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("SPECTRAIN_VERBOSE", "VLLM_LOGGING_LEVEL")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_a_log_shows_spectrain_lines_and_one_line_per_step(tmp_path):
    out = fit_output(tmp_path / "run")
    lines = out.splitlines()
    assert [line.split("  ")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert sum("[spectrain] vLLM runs on CPU" in line for line in lines) == 1
    assert any(line.startswith("[spectrain] warm-start SFT: 20 steps, loss ") for line in lines), out[-3000:]
    assert not [line for line in lines if any(n in line for n in NOISE)], out[-3000:]
    assert "\r" not in out  # no bar redraws in a log


def test_verbose_shows_what_the_quiet_console_hides(tmp_path):
    out = fit_output(tmp_path / "run", "--verbose")
    assert "WARNING" in out and "GPU available" in out and "[spectrain] vLLM runs on CPU" not in out

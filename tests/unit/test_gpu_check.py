"""`scripts/gpu_check.sh` on a machine without a GPU: it fails loudly at once, it never passes by skipping."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run for real")
def test_gpu_check_without_a_gpu_fails_at_the_environment_step(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[gpu_check] environment: FAILED" in proc.stdout and "no CUDA device" in proc.stdout, proc.stdout
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(summary["steps"]) == ["environment"] and not summary["steps"]["environment"]["ok"], summary


def test_gpu_check_refuses_an_unknown_option():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--fast"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr, proc.stderr

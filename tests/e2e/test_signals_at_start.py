"""SIGTERM / SIGINT before the training loop: the same one line and exit code as in it, and nothing half-written.

Each case runs `spectrain fit tiny_cpu` as a user's shell (or a scheduler) does, in a subprocess, waits
until it is inside the phase, sends the signal, and checks the exit code (128 + signal), that the last
line is the one `error:` line naming the phase, that no traceback is printed, that no partial warm-start
cache is left behind, and that the same command is accepted again.
"""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spectrain.config import load_config
from spectrain.train.trainer import SpecTrainer

QUICK = ["trainer.progress_bar=false", "draft.warmup_steps=2", "eval.prompts=4", "eval.samples=2"]


def start(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, list[str]]:
    argv = ["fit", "tiny_cpu", f"trainer.run_dir={tmp_path / 'run'}", *QUICK, *overrides]
    process = subprocess.Popen([sys.executable, "-m", "spectrain.cli", *argv], cwd=tmp_path, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return process, argv


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def assert_stopped(process: subprocess.Popen, signum: int, phase: str) -> str:
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err, err
    last = err.rstrip().splitlines()[-1]
    assert last.startswith(f"error: stopped by {signal.Signals(signum).name} during {phase}"), err
    assert last.endswith("Run the same command again to continue."), last
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [last], err
    return last


def assert_no_partial_cache(run: Path) -> None:
    leftovers = [p for p in run.rglob("*") if ".partial-" in p.name]
    assert not leftovers, leftovers


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM])  # SIGINT takes the same handler (tests/unit/test_callbacks.py)
def test_a_signal_during_the_warm_start_stops_at_once_and_leaves_no_cache(tmp_path, signum):
    process, argv = start(tmp_path, "sft.steps=100000")  # the SFT would run for an hour
    run = tmp_path / "run"
    wait_for(run / "config.yaml", process)
    time.sleep(3)  # inside the SFT loop by now
    process.send_signal(signum)
    assert_stopped(process, signum, "the warm start")
    assert_no_partial_cache(run)
    assert not (run / "warmstart").exists()
    assert SpecTrainer(load_config("tiny_cpu", argv[2:])).check_inputs() == (None, 0)  # the same command goes on


@pytest.mark.slow
@pytest.mark.vllm
def test_a_signal_during_the_engine_start_names_it(tmp_path):
    process, argv = start(tmp_path, "sft.steps=2")
    run = tmp_path / "run"
    wait_for(run / "engine_init" / "draft" / "config.json", process)  # exported: vLLM is starting on it
    time.sleep(1)
    process.send_signal(signal.SIGTERM)
    assert_stopped(process, signal.SIGTERM, "the engine start")
    assert_no_partial_cache(run)
    assert (run / "warmstart" / "meta.json").is_file()  # the warm start it finished is kept, and reused
    assert SpecTrainer(load_config("tiny_cpu", argv[2:])).check_inputs() == (None, 0)

"""docs/python_api.md's example, run as it is written: a subclass with its own prompt source, a batched reward
that reads the prompt, and a callback reading each `StepResult`."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
DOC = Path(__file__).resolve().parents[2] / "docs" / "python_api.md"


def example_code() -> str:
    (code,) = re.findall(r"## A complete example\n.*?```python\n(.*?)```", DOC.read_text(), flags=re.S)
    return code


def test_the_documented_example_runs_and_its_callback_reads_every_step(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example_code())
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "python_api_example"
    rows = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["reward"] <= 1 and r["tokens_per_s"] > 0 and r["acceptance_length"] >= 1 for r in rows), rows
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["steps"] == 3 and 0 <= summary["final"]["greedy_reward"] <= 1
    assert json.loads((run / "spectrain_run.json").read_text())["result"]["steps"] == 3

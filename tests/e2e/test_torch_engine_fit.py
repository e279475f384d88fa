"""`spectrain fit` with `rollout.engine=torch` on a machine where vLLM cannot be imported (the GPU check's)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TINY, column, metrics

REPO = Path(__file__).resolve().parents[2]
# `import vllm` anywhere in the run raises ImportError, as on a machine without it
WITHOUT_VLLM = "import sys; sys.modules['vllm'] = None; from spectrain.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.slow
def test_fit_with_the_torch_engine_never_imports_vllm(tmp_path):
    run_dir = tmp_path / "run"
    args = ["fit", "tiny_cpu", f"trainer.run_dir={run_dir}", "trainer.max_steps=2", "trainer.accelerator=cpu",
            "rollout.engine=torch", *TINY, "sync.check_alive=true"]  # the alive check sees no drafts: a no-op
    done = subprocess.run([sys.executable, "-c", WITHOUT_VLLM, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = metrics(run_dir)
    assert {int(r["step"]) for r in rows if r.get("policy/loss")} == {1, 2}
    rewards, losses = column(rows, "reward"), column(rows, "policy/loss")
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards), rewards
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    # the engine samples from the synced policy: its logprobs are the trainer's (float32), and every sync verifies
    diffs = column(rows, "policy/engine_logprob_diff")
    assert len(diffs) == 2 and all(0 <= d < 1e-4 for d in diffs), diffs
    assert column(rows, "sync/mismatches") == [0.0, 0.0]
    draft_losses = column(rows, "draft/loss")  # the draft co-trains, though this engine never drafts with it
    assert len(draft_losses) == 2 and all(math.isfinite(x) and x > 0 for x in draft_losses), draft_losses
    assert not column(rows, "spec/mean_acceptance_length")
    assert column(rows, "rollout/max_running") == [16.0, 16.0] and column(rows, "rollout/preemptions") == [0.0, 0.0]
    summary = json.loads((run_dir / "spectrain_run.json").read_text())["result"]
    assert summary["steps"] == 2 and 0 <= summary["final"]["sampled_reward"] <= 1, summary
    assert (run_dir / "final/policy/model.safetensors").is_file() and (run_dir / "final/draft/config.json").is_file()

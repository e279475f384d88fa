"""The steps of `scripts/gpu_check.sh` (run it through that script: it sets up PYTHONPATH and the wheels).

1. environment: CUDA torch >= 2.11, Triton, Lightning, transformers (none may be missing);
2. tests: every `gpu`-marked test, compiled on the GPU (a skip fails, except an optional backend not installed);
3. fit: GRPO steps of the tiny recipe in bf16 on the GPU, policy + co-trained draft, torch sampling engine, no vLLM;
4. bench: `spectrain bench kernels` (TTT attention and the draft loss vs the torch paths, 4K-64K tokens).
`--mode cpu-dry-run` runs the same steps on CPU: kernel tests under the Triton interpreter, tiny sizes.
A summary goes to `gpu_check.json` beside the benchmark's files; the exit code is 1 when any step failed.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 8 * 60
KERNEL_TESTS = ["tests/unit/test_triton_attention.py", "tests/unit/test_lse_merge_triton.py",
                "tests/unit/test_draft_loss.py", "tests/unit/test_attention_backends.py"]
FIT_STEPS = 4
FIT = ["rollout.engine=torch", "policy.dtype=bfloat16", f"trainer.max_steps={FIT_STEPS}", "sft.steps=60",
       "draft.warmup_steps=20", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.eval_prompts=8",
       "rollout.eval_samples=2", "trainer.eval_every_n_steps=0", "trainer.progress_bar=false",
       "draft.check_alive=false", "trainer.resume=never"]
BENCH_TINY = ["tokens=64,128", "doc_tokens=40", "heads=4", "kv_heads=2", "head_dim=16", "hidden=32", "vocab=64",
              "chunk=16", "reps=1", "dtype=float32"]
NO_VLLM = "import sys; sys.modules['vllm'] = None; from spectrain.cli import main; sys.exit(main())"


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, text=True)


def check_environment(gpu: bool) -> str:
    import lightning
    import torch
    import transformers
    import triton

    versions = (f"torch {torch.__version__}, triton {triton.__version__}, lightning {lightning.__version__}, "
                f"transformers {transformers.__version__}")
    if gpu:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
        assert (major, minor) >= (2, 11), f"torch {torch.__version__}: the GPU path needs torch >= 2.11"
        assert torch.cuda.is_available(), f"no CUDA device visible to torch ({versions})"
        versions += f", {torch.cuda.get_device_name()}"
    return versions


def run_tests(gpu: bool) -> str:
    if gpu:
        cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-m", "gpu", "tests"]
        proc = run(cmd, {"SPECTRAIN_REQUIRE_GPU": "1"})
    else:
        cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-m", "not gpu and not slow", *KERNEL_TESTS]
        proc = run(cmd, {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, f"pytest exited {proc.returncode} (its output is above)"
    return " ".join(cmd[3:])


def fit_metrics(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted((run_dir / "logs").glob("version_*/metrics.csv")):
        with open(path) as f:
            rows += list(csv.DictReader(f))
    return rows


def values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


def run_fit(gpu: bool, work: Path) -> dict:
    run_dir = work / "fit"
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["fit", "tiny_cpu", *FIT, f"trainer.accelerator={'cuda' if gpu else 'cpu'}",
            f"trainer.run_dir={run_dir}"]
    proc = run([sys.executable, "-c", NO_VLLM, *args])
    assert proc.returncode == 0, f"spectrain fit exited {proc.returncode} (its output is above)"
    rows = fit_metrics(run_dir)
    summary = {key: values(rows, key) for key in ("policy/loss", "draft/loss", "reward", "policy/engine_logprob_diff",
                                                  "rollout/tokens_per_s", "time/step")}
    assert len(summary["policy/loss"]) == FIT_STEPS, f"{len(summary['policy/loss'])} of {FIT_STEPS} steps logged"
    for key, xs in summary.items():
        assert xs and all(math.isfinite(x) for x in xs), f"{key}: {xs} (missing or not finite)"
    assert max(summary["policy/engine_logprob_diff"]) < 5e-2, (
        f"trainer vs engine logprobs differ by {max(summary['policy/engine_logprob_diff'])} (bf16 limit 5e-2)")
    return summary


def run_bench(gpu: bool, out: Path) -> dict:
    args = [f"out={out}"] + ([] if gpu else BENCH_TINY)
    proc = run([sys.executable, "-m", "spectrain.cli", "bench", "kernels", *args])
    assert proc.returncode == 0, f"spectrain bench kernels exited {proc.returncode} (its output is above)"
    result = json.loads((out / "kernels.json").read_text())
    return {k: result[k] for k in ("ttt_attention_speedup_triton_over_torch",
                                   "draft_loss_peak_memory_triton_over_torch")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("gpu", "cpu-dry-run"), default="gpu")
    gpu = parser.parse_args().mode == "gpu"
    out = REPO / ("docs/benchmarks/gpu" if gpu else "runs/gpu_check_dry_run")
    out.mkdir(parents=True, exist_ok=True)
    steps = {"environment": lambda: check_environment(gpu), "tests": lambda: run_tests(gpu),
             "fit": lambda: run_fit(gpu, REPO / "runs" / "gpu_check"), "bench": lambda: run_bench(gpu, out)}
    report, start = {"mode": "gpu" if gpu else "cpu-dry-run", "steps": {}}, time.time()
    for name, step in steps.items():
        began = time.time()
        try:
            detail, ok = step(), True
        except Exception as exc:  # every step runs; the summary says which failed and why
            detail, ok = f"{type(exc).__name__}: {exc}", False
        report["steps"][name] = {"ok": ok, "seconds": round(time.time() - began, 1), "detail": detail}
        print(f"[gpu_check] {name}: {'ok' if ok else 'FAILED'} ({report['steps'][name]['seconds']} s) {detail}",
              flush=True)
    report["seconds"] = round(time.time() - start, 1)
    report["within_budget"] = report["seconds"] <= BUDGET_S
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    if os.environ.get("OUT"):  # the device machine returns what lies under $OUT
        for name in ("gpu_check.json", "kernels.json", "kernels.md", "kernels.png"):
            if (out / name).is_file():
                shutil.copy(out / name, Path(os.environ["OUT"]) / name)
    failed = [name for name, s in report["steps"].items() if not s["ok"]]
    print(f"[gpu_check] {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'} in {report['seconds']} s "
          f"(budget {BUDGET_S} s); summary in {out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

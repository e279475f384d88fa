"""The steps of `scripts/gpu_check.sh` (run it through that script: it sets up PYTHONPATH and the wheels).

1. environment: CUDA torch >= 2.11, Triton, Lightning, transformers (none may be missing);
2. tests: every `gpu`-marked test, compiled on the GPU (a skip fails, except an optional backend not installed);
3. fit: GRPO steps of the tiny recipe in bf16 on the GPU, policy + co-trained draft, torch sampling engine, no vLLM;
4. bench: `spectrain bench kernels` (TTT attention and the draft loss vs the torch paths, 4K-64K tokens);
5. speedup, where vLLM is installed: `spectrain bench speedup` on a GPU-sized target (0.6B parameters from
   config, bf16, ~160-token responses, 128 sequences) in modes none, frozen and co-trained, with the engine's CUDA
   defaults: CUDA graphs, prefix caching reset after every sync, sleep mode with a wake before every sync (the
   co-trained run must accept draft tokens at every step: a drafter lost on wake stops it). Not run (and not a
   failure) without vLLM or in the dry run; not counted in the time budget.
`--mode cpu-dry-run` runs the same steps on CPU (kernel tests under the Triton interpreter, tiny sizes), plus
`compile`: every kernel compiled offline for sm_90 (shared memory, registers, spills; `tests/triton_compile.py`).
A summary goes to `gpu_check.json` beside the benchmark's files; the exit code is 1 when any step failed.
"""
from __future__ import annotations

import argparse
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
       "draft.warmup_steps=20", "rollout.prompts_per_step=4", "rollout.n=4", "eval.prompts=8",
       "eval.samples=2", "eval.every_n_steps=0", "trainer.progress_bar=false",
       "sync.check_alive=false", "trainer.resume=never"]
# on CPU the kernels the GPU run picks by `auto` are named (the interpreter is slow: the rollouts stay on torch)
FIT_DRY_RUN = ["draft.loss_kernel=triton"]
INTERPRETER = {"TRITON_INTERPRET": "1"}
COMPILED = {"TRITON_INTERPRET": None}  # an inherited interpreter setting would hide the real compile
# the GPU-sized speedup study: 24 x 1536 (12 heads of 128, 2 KV heads), 16-digit worked sums
SPEEDUP = ["trainer.accelerator=cuda", "policy.dtype=bfloat16", "toy.hidden_size=1536",
           "toy.intermediate_size=4096", "toy.num_hidden_layers=24", "toy.num_attention_heads=12",
           "toy.num_key_value_heads=2", "toy.max_position_embeddings=256", "rollout.max_model_len=256",
           "toy.digits=16", "rollout.response_length=192", "rollout.prompts_per_step=16", "rollout.n=8",
           "sft.steps=300", "sft.lr=3e-4", "draft.warmup_steps=200", "draft.hold_tolerance=0.05"]
NO_VLLM = "import sys; sys.modules['vllm'] = None; from spectrain.cli import main; sys.exit(main())"


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`cmd` in the repository with `env` over this environment (a None value unsets that variable)."""
    print("$", " ".join(cmd), flush=True)
    merged = {**os.environ, **(env or {})}
    return subprocess.run(cmd, cwd=REPO, env={k: v for k, v in merged.items() if v is not None}, text=True)


def compile_offline() -> str:
    """The dry run's stand-in for the GPU's own compile: every kernel built for sm_90 here."""
    cmd = [sys.executable, "-m", "tests.triton_compile", "--arch", "90"]
    proc = run(cmd, COMPILED)
    assert proc.returncode == 0, f"offline compile for sm_90 exited {proc.returncode} (its output is above)"
    return " ".join(cmd[1:])


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
    pytest = [sys.executable, "-m", "pytest", "-q", "-ra", "--import-mode=append"]  # the staged package first
    if gpu:
        cmd = [*pytest, "-m", "gpu", "tests"]
        proc = run(cmd, {"SPECTRAIN_REQUIRE_GPU": "1", **COMPILED})
    else:
        cmd = [*pytest, "-m", "not gpu and not slow", *KERNEL_TESTS]
        proc = run(cmd, INTERPRETER)
    assert proc.returncode == 0, f"pytest exited {proc.returncode} (its output is above)"
    return " ".join(cmd[3:])


def run_fit(gpu: bool, work: Path) -> dict:
    run_dir = work / "fit"
    shutil.rmtree(run_dir, ignore_errors=True)
    device = ["trainer.accelerator=cuda"] if gpu else ["trainer.accelerator=cpu", *FIT_DRY_RUN]
    proc = run([sys.executable, "-c", NO_VLLM, "fit", "tiny_cpu", *FIT, *device, f"trainer.run_dir={run_dir}"],
               COMPILED if gpu else INTERPRETER)
    assert proc.returncode == 0, f"spectrain fit exited {proc.returncode} (its output is above)"
    from tests.helpers import column, metrics  # the suite's reader of a run's metrics.csv

    rows = metrics(run_dir)
    summary = {key: column(rows, key) for key in ("policy/loss", "draft/loss", "reward", "policy/engine_logprob_diff",
                                                  "rollout/tokens_per_s", "time/step")}
    assert len(summary["policy/loss"]) == FIT_STEPS, f"{len(summary['policy/loss'])} of {FIT_STEPS} steps logged"
    for key, xs in summary.items():
        assert xs and all(math.isfinite(x) for x in xs), f"{key}: {xs} (missing or not finite)"
    assert max(summary["policy/engine_logprob_diff"]) < 1e-1, (
        f"trainer vs engine logprobs differ by {max(summary['policy/engine_logprob_diff'])} (bf16 limit 1e-1)")
    return summary


def run_bench(gpu: bool, out: Path) -> dict:
    proc = run([sys.executable, "-m", "spectrain.cli", "bench", "kernels", f"out={out}"],
               COMPILED if gpu else INTERPRETER)  # without a GPU the benchmark takes its tiny CPU sizes
    assert proc.returncode == 0, f"spectrain bench kernels exited {proc.returncode} (its output is above)"
    result = json.loads((out / "kernels.json").read_text())
    return {k: result[k] for k in ("ttt_attention_speedup_triton_over_torch",
                                   "draft_loss_peak_memory_triton_over_torch")}


def run_speedup(gpu: bool, out: Path) -> dict | str:
    import importlib.util

    if not gpu:
        return "not run in the dry run (the CPU study is docs/benchmarks/speedup.md)"
    if importlib.util.find_spec("vllm") is None:
        return "not run: vLLM is not installed (sleep mode, CUDA graphs and the prefix-cache reset are unchecked)"
    work = REPO / "runs" / "gpu_check_speedup"
    proc = run([sys.executable, "-m", "spectrain.cli", "bench", "speedup", "tiny_cpu", "steps=4", "rounds=1",
                "modes=none,frozen,cotrained", "ks=", f"out={out / 'speedup'}", f"work={work}", *SPEEDUP], COMPILED)
    assert proc.returncode == 0, f"spectrain bench speedup exited {proc.returncode} (its output is above)"
    result = json.loads((out / "speedup" / "speedup.json").read_text())
    [cotrained] = result["runs"]["cotrained"]
    acceptance = cotrained["per_step"]["spec/mean_acceptance_length"]
    assert acceptance and all(a > 1.0 for a in acceptance), f"co-trained acceptance per step {acceptance}"
    return {key: value["median"] for key, value in result["headline"].items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("gpu", "cpu-dry-run"), default="gpu")
    parser.add_argument("--out", type=Path, help="results folder (default docs/benchmarks/gpu; dry run: runs/...)")
    args = parser.parse_args()
    gpu = args.mode == "gpu"
    out = args.out or REPO / ("docs/benchmarks/gpu" if gpu else "runs/gpu_check_dry_run")
    out.mkdir(parents=True, exist_ok=True)
    steps = {"environment": lambda: check_environment(gpu), "tests": lambda: run_tests(gpu),
             "fit": lambda: run_fit(gpu, REPO / "runs" / ("gpu_check" if gpu else "gpu_check_dry_run")),
             "bench": lambda: run_bench(gpu, out), "speedup": lambda: run_speedup(gpu, out)}
    if not gpu:
        steps["compile"] = compile_offline
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
        if name == "environment" and not ok:
            break  # without the GPU or its packages every later step would only fail the same way
    report["seconds"] = round(time.time() - start, 1)
    budgeted = report["seconds"] - report["steps"].get("speedup", {}).get("seconds", 0.0)
    report["within_budget"] = budgeted <= BUDGET_S  # the check is meant to fit a short GPU loan
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    failed = [name for name, s in report["steps"].items() if not s["ok"]]
    if gpu and not report["within_budget"]:
        failed.append(f"the {BUDGET_S} s budget")
    print(f"[gpu_check] {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'} in {report['seconds']} s "
          f"(budget {BUDGET_S} s); summary in {out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

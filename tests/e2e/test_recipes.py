"""The packaged adaptive recipes and `spectrain calibrate`, end to end through the CLI as users run them.

Each fit is 2 GRPO steps on shrunk settings (TINY). The concurrency and bandit recipes also run as a user types
them (`spectrain fit` in its own process, with its CPU runtime) beside another 2-thread process, as on a shared
machine; those two and the long-tail fit share one warm-start cache (`trainer.warmstart_dir`: the SFT policy and
the draft warm-up do not depend on the speculation settings). The user-recipe fit inherits tiny_cpu_bandit with a
JSONL task in the README's format (no worked targets), the TensorBoard logger and a callback named in the recipe,
and no verify budget, so `spectrain fit` calibrates one itself.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from spectrain.cli import main as cli_main
from spectrain.config import load_config
from spectrain.rollout.speculation.calibration import load_verify_budget
from spectrain.tasks.arithmetic import ArithmeticTask
from spectrain.tasks.tokenizer import CharTokenizer
from tests.helpers import TINY, column, metrics

STEPS = 2
QUICK = [*TINY, f"trainer.max_steps={STEPS}", "eval.every_n_steps=0"]  # held-out eval before and after only
K_MAX = 4  # draft.num_speculative_tokens of tiny_cpu_concurrency and tiny_cpu_bandit


class CallRecorder(Callback):
    """A callback a recipe names in `trainer.callbacks`: appends each hook call to a JSONL file."""

    def __init__(self, path: str, tag: str) -> None:
        self.path, self.tag = Path(path), tag

    def on_fit_start(self, trainer, pl_module) -> None:
        self._record("fit_start", trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._record("train_batch_end", trainer.global_step, result_step=outputs["step"].step)

    def _record(self, hook: str, step: int, **more) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"hook": hook, "step": step, "tag": self.tag, **more}) + "\n")


@pytest.fixture(scope="session")
def shared_warmstart(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("warmstart")


def fit(recipe, run_dir: Path, *overrides: str) -> dict:
    """`spectrain fit RECIPE ...` as a user types it; the run's recorded summary."""
    assert cli_main(["fit", str(recipe), f"trainer.run_dir={run_dir}", *QUICK, *overrides]) == 0
    return json.loads((run_dir / "spectrain_run.json").read_text())["result"]


def assert_rewards_in_unit_interval(summary: dict, train_rewards: list[float]) -> None:
    """Per step and held out, before and after: finite (NaN fails every comparison) and in [0, 1]."""
    assert len(train_rewards) == STEPS
    held_out = [summary[when][key] for when in ("warmstart", "final") for key in ("greedy_reward", "sampled_reward")]
    assert all(0.0 <= r <= 1.0 for r in [*train_rewards, *held_out]), (train_rewards, held_out)


def assert_speculation_accepts(acceptance_lengths: list[float]) -> None:
    """vLLM accepted draft tokens in every step's rollout: the synced draft is alive."""
    assert len(acceptance_lengths) == STEPS and all(a > 1.0 for a in acceptance_lengths), acceptance_lengths


BUSY = "import torch; torch.set_num_threads(2); a = torch.randn(384, 384)\nwhile True: a @ a"


@pytest.fixture
def busy_machine():
    """Another 2-thread process keeping the cores busy, as on a shared machine."""
    process = subprocess.Popen([sys.executable, "-c", BUSY])
    yield
    process.kill()
    process.wait()


def fit_beside_other_work(recipe, run_dir: Path, *overrides: str) -> dict:
    """`spectrain fit RECIPE ...` as a user types it (the command's own CPU runtime), on a busy machine."""
    done = subprocess.run([sys.executable, "-m", "spectrain", "fit", recipe, f"trainer.run_dir={run_dir}", *QUICK,
                           *overrides], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_dir / "spectrain_run.json").read_text())["result"]


@pytest.mark.slow
def test_concurrency_recipe_moves_k_with_the_live_batch_on_a_busy_machine(tmp_path, shared_warmstart, busy_machine):
    run = tmp_path / "run"
    summary = fit_beside_other_work("tiny_cpu_concurrency", run, f"trainer.warmstart_dir={shared_warmstart}",
                                    "speculation.verify_budget=24")
    rows = metrics(run)
    assert_rewards_in_unit_interval(summary, column(rows, "reward"))
    assert_speculation_accepts(column(rows, "spec/mean_acceptance_length"))
    # C = 24: k = 24 // 16 - 1 = 0 with all 16 sequences live, k_max = 4 once 4 or fewer are; a mean
    # strictly between means the rule changed k inside each rollout
    k_means = column(rows, "spec/k_mean")
    assert len(k_means) == STEPS and all(0 < k < K_MAX for k in k_means), k_means
    assert not (run / "calibration.json").exists()  # a configured budget needs no calibration


@pytest.mark.slow
def test_bandit_recipe_calibrates_and_runs_on_a_busy_machine(tmp_path, shared_warmstart, busy_machine):
    """The verify budget that `fit` measures before its engine starts must not stop the run: a busy machine
    scrambles the timings (measured on the fastest of 3 sweeps, else C falls back to the largest count)."""
    run = tmp_path / "run"
    summary = fit_beside_other_work("tiny_cpu_bandit", run, f"trainer.warmstart_dir={shared_warmstart}")
    assert summary["steps"] == STEPS
    assert json.loads((run / "calibration.json").read_text())["verify_budget"] >= 1


@pytest.mark.slow
def test_longtail_recipe_trains_the_draft_in_the_tail(tmp_path, shared_warmstart):
    run = tmp_path / "run"
    summary = fit("tiny_cpu_longtail", run, f"trainer.warmstart_dir={shared_warmstart}")
    rows = metrics(run)
    assert_rewards_in_unit_interval(summary, column(rows, "reward"))
    assert_speculation_accepts(column(rows, "spec/mean_acceptance_length"))
    # step 1 has no taps to train on yet; step 2's tail ran 1..max_updates (4) spot updates
    spot_updates = column(rows, "spot/draft_updates")
    assert len(spot_updates) == 1 and 1 <= spot_updates[0] <= 4, spot_updates
    assert all(math.isfinite(loss) for loss in column(rows, "draft/loss"))


def write_readme_jsonl(path: Path, rows: int) -> Path:
    """Prompts in the README's format: {"prompt", "answer"} per line, no worked "target"."""
    examples = ArithmeticTask(digits=2, operands=2, seed=1).sample(rows)
    path.write_text("".join(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n" for ex in examples))
    return path


def tensorboard_scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[float]] = {}
    for version in sorted(log_dir.glob("version_*")):
        events = EventAccumulator(str(version))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in events.Scalars(tag))
    return scalars


def test_warm_start_teaches_the_answer_of_a_row_without_target(tmp_path):
    """SFT completions: a row's worked target when it has one, else its answer (then EOS)."""
    from dataclasses import replace

    from spectrain.tasks.sources import build_prompt_source
    from spectrain.train.warm_start import examples_to_batch

    tok = CharTokenizer()
    bare, other = build_prompt_source("files", files=write_readme_jsonl(tmp_path / "p.jsonl", rows=2)).examples
    worked = replace(other, target=f"worked;{other.answer}")
    batch = examples_to_batch([bare, worked], tok)
    bounds = batch.cu_seqlens.tolist()
    taught = [batch.targets[lo:hi][batch.response_mask[lo:hi]].tolist() for lo, hi in zip(bounds, bounds[1:])]
    assert taught == [tok.encode(text, add_bos=False) + [tok.eos_id] for text in (bare.answer, worked.target)]


@pytest.mark.slow
def test_bandit_user_recipe_with_jsonl_task_tensorboard_mlflow_and_callback(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run directory's own file store
    prompts = write_readme_jsonl(tmp_path / "prompts.jsonl", rows=64)
    calls = tmp_path / "calls.jsonl"
    recipe = tmp_path / "my_bandit.yaml"
    recipe.write_text(f"defaults: [tiny_cpu_bandit]\n"
                      f"task: {{name: files}}\ndata: {{train_files: {prompts}}}\n"
                      f"trainer:\n"
                      f"  logger: [tensorboard, mlflow]\n"
                      f"  log_samples_every_n_steps: 1\n"
                      f"  log_samples_n: 2\n"
                      f"  callbacks:\n"
                      f"    - {{target: test_recipes.CallRecorder, args: {{path: {calls}, tag: from-recipe}}}}\n")
    run = tmp_path / "run"
    summary = fit(recipe, run)

    # no budget configured or calibrated: fit measured one before starting its engine, and kept it
    budget = json.loads((run / "calibration.json").read_text())["verify_budget"]
    assert budget >= 1 and f"verify budget C = {budget} " in capsys.readouterr().out
    # the rows have no worked target: the warm start learnt the bare answers (below a uniform guess)
    warm = json.loads((run / "warmstart" / "meta.json").read_text())
    assert warm["steps"] == 20 and warm["final_loss"] < math.log(CharTokenizer().vocab_size)

    scalars = tensorboard_scalars(run / "logs")
    assert not list((run / "logs").glob("version_*/metrics.csv"))
    assert_rewards_in_unit_interval(summary, scalars["reward"])
    assert_speculation_accepts(scalars["spec/mean_acceptance_length"])
    # MLflow (a file store in the run directory) holds the same rewards, and a sample table per step
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run / "mlruns").resolve().as_uri())
    run_id = json.loads((run / "logger_ids.json").read_text())["mlflow"]
    assert [m.value for m in client.get_metric_history(run_id, "reward")] == pytest.approx(scalars["reward"])
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == ["samples/step_000001.json",
                                                                          "samples/step_000002.json"]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2] and all(0 <= s["reward"] <= 1 for s in samples)
    assert all(s["prompt"] and s["completion_tokens"] >= 1 for s in samples)

    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert recorded[0] == {"hook": "fit_start", "step": 0, "tag": "from-recipe"}
    ends = [r for r in recorded if r["hook"] == "train_batch_end"]
    assert [(r["step"], r["result_step"]) for r in ends] == [(1, 1), (2, 2)]  # StepResult.step counts from 1

    # the controller's plays per (batch bucket, arm), checkpointed: it tried more than one k
    counts = torch.load(run / "checkpoints" / "last.ckpt",
                        weights_only=False)["speculation_controller"]["selector"]["counts"]
    arms_played = {arm for bucket in counts for arm, plays in enumerate(bucket) if plays}
    assert len(arms_played) > 1, counts


@pytest.mark.slow
def test_calibrate_writes_a_positive_verify_budget(tmp_path, shared_warmstart, capsys):
    run = tmp_path / "run"
    overrides = [f"trainer.run_dir={run}", f"trainer.warmstart_dir={shared_warmstart}", *QUICK]
    warm_started = (shared_warmstart / "policy" / "config.json").is_file()  # after the fits above
    assert cli_main(["calibrate", "tiny_cpu_concurrency", *overrides]) == 0
    saved = json.loads((run / "calibration.json").read_text())
    assert saved["verify_budget"] >= 1 and f"verify budget C = {saved['verify_budget']} " in capsys.readouterr().out
    assert len(saved["times_s"]) == len(saved["token_counts"]) >= 3 and all(t > 0 for t in saved["times_s"])
    assert (saved["meta"]["policy"] == str(shared_warmstart / "policy")) == warm_started
    # `spectrain fit` with the same recipe and overrides reads it
    assert load_verify_budget(load_config("tiny_cpu_concurrency", overrides), run) == saved["verify_budget"]

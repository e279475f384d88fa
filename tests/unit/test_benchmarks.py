"""`spectrain bench` finds the benchmarks in the source tree, rejects bad options clearly, and
the benchmarks' pure summaries compute what their reports print. No benchmark runs here at
its real size (each takes minutes; see docs/benchmarks/); `bench kernels` runs its tiny CPU dry run."""
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spectrain import cli
from spectrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _bench(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["bench", *args])
    return code, capsys.readouterr().err


def test_the_cli_lists_every_benchmark_module():
    modules = {p.stem for p in (REPO / "benchmarks").glob("*.py")} - {"__init__", "common"}
    assert set(cli.BENCHMARKS) == modules


@pytest.mark.parametrize("name", cli.BENCHMARKS)
def test_every_benchmark_imports_and_has_main(name):
    assert callable(importlib.import_module(f"benchmarks.{name}").main)


@pytest.mark.parametrize("args, message", [
    (("pp", "layerz=4"), "bench pp: unknown option(s) layerz=4; use key=value with key in "),
    (("pp", "rounds=many"), "bench pp: rounds='many': expected int, like the default rounds=8"),
    (("cp", "tokens=1k,2k"), "bench cp: tokens='1k,2k' is not a comma-separated list of integers"),
    (("cp", "cp=2,4"), "bench cp: cp=2,4 has no 1"),
    (("adaptive", "prompts"), "bench adaptive: unknown option(s) prompts;"),
    (("drift", "no_such.key=1"), "bench drift: "),
    (("kernels", "dtype=fp8"), "bench kernels: dtype='fp8'; use one of bfloat16, float16, float32"),
])
def test_a_bad_option_is_one_clear_error_before_any_work(capsys, args, message):
    """The error comes from the benchmark module itself: `spectrain bench NAME` found and imported it."""
    code, err = _bench(capsys, *args)
    assert code == 2
    assert err.startswith(f"error: {message}"), err
    assert len(err.strip().splitlines()) == 1


def test_bench_name_help_shows_the_benchmarks_own_options(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "pp", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    assert out.startswith("`spectrain bench pp`: what carrying the draft's taps")  # its docstring
    assert "\n  rounds=8\n" in out and "\n  out=runs/bench_pp\n" in out  # its options, with their defaults
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--help"])
    assert stop.value.code == 0 and "`spectrain bench NAME --help` shows what NAME measures" in capsys.readouterr().out


@pytest.mark.parametrize("name", cli.BENCHMARKS)
def test_a_benchmark_writes_under_runs_unless_told_otherwise(name):
    """The committed reports in docs/benchmarks/ are regenerated only by a command that names them (`out=...`)."""
    defaults = importlib.import_module(f"benchmarks.{name}").DEFAULTS
    assert defaults.get("out", defaults.get("out_dir")) == f"runs/bench_{name}"


def test_without_the_source_tree_the_cli_says_where_benchmarks_live(capsys, monkeypatch, tmp_path):
    """An installed wheel has no benchmarks/ beside the package."""
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "spectrain" / "cli.py"))
    code, err = _bench(capsys, "drift")
    assert code == 2
    assert f"no {tmp_path / 'site-packages' / 'benchmarks'} folder" in err
    assert "pip install -e ." in err
    with pytest.raises(SystemExit) as stop:  # its help says so too, in the same one line
        cli.main(["bench", "drift", "--help"])
    assert stop.value.code == 2 and capsys.readouterr().err.strip() == err.strip()


def test_bench_kernels_without_a_gpu_is_a_dry_run_of_every_path(tmp_path):
    """`spectrain bench kernels` on this CPU: tiny sizes, Triton under the interpreter, every implementation
    measured and written (a fresh process, as a user runs it: the interpreter must be chosen before the kernels)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "spectrain.cli", "bench", "kernels", "tokens=48", f"out={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "no GPU: a correctness dry run" in proc.stdout
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert {(r["tokens"], r["impl"]) for r in result["rows"]["attention"]} == {(48, "torch"), (48, "triton")}
    assert {r["impl"] for r in result["rows"]["loss"]} == {"torch", "chunked", "triton"}
    assert all(r["ms"] > 0 and r["peak_mib"] is None for rows in result["rows"].values() for r in rows)
    assert (tmp_path / "kernels.png").stat().st_size > 0 and "| 48 | triton |" in (tmp_path / "kernels.md").read_text()


def test_the_package_never_imports_a_benchmark():
    """At run time too (tests/unit/test_layers.py checks the source): `fit` and the CLI leave them out."""
    code = ("import sys, spectrain.cli, spectrain.train.trainer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------ pure helpers
def test_split_options_converts_known_keys_and_passes_the_rest_on():
    from benchmarks.common import split_options

    options, rest = split_options("x", ["steps=3", "grpo.lr=1e-4", "out=/tmp/o", "flag"],
                                  {"steps": 20, "out": "docs", "scale": 1.5})
    assert options == {"steps": 3, "out": "/tmp/o", "scale": 1.5}
    assert rest == ["grpo.lr=1e-4", "flag"]


def test_paired_ratios_pair_rounds_not_medians():
    from benchmarks.common import paired_ratios

    r = paired_ratios([2.0, 9.0, 3.0], [1.0, 10.0, 1.0])
    assert r["runs"] == [2.0, 0.9, 3.0]
    assert (r["median"], r["min"], r["max"]) == (2.0, 0.9, 3.0)
    with pytest.raises(ValueError):  # unpaired lists are a bug, not a shorter summary
        paired_ratios([1.0, 2.0], [1.0])


@pytest.mark.parametrize("tokens", [1024, 5000, 32768])
def test_cp_documents_cover_the_tokens_unequally(tokens):
    from benchmarks.cp import MAX_DOC, doc_lengths

    lens = doc_lengths(tokens)
    assert sum(lens) == tokens and len(lens) >= 4
    assert len(set(lens)) > 1  # unequal: zigzag balance is exercised
    assert max(lens[1:]) <= MAX_DOC


def test_cp_staircase_mask_is_the_causal_trunk_then_one_diagonal_per_pass():
    from benchmarks.cp import staircase_mask

    mask = staircase_mask(torch.tensor([0, 2, 5]), passes=2)
    assert mask.shape == (5, 10)
    assert mask[1, :2].tolist() == [True, True] and not mask[2, :2].any()  # no attention across documents
    assert mask[2, 2:5].tolist() == [True, False, False]  # causal
    assert mask[:, 5:].equal(torch.eye(5, dtype=torch.bool))


def test_cp_loglog_slope():
    from benchmarks.cp import loglog_slope

    assert loglog_slope([1, 1000, 2000], [5, 10, 20]) == pytest.approx(1.0)
    assert loglog_slope([1000, 2000], [1, 4]) == pytest.approx(2.0)


def test_pp_overhead_is_paired_per_round():
    from benchmarks.pp import _paired

    r = _paired([1.1, 2.2, 1.0], [1.0, 2.0, 1.0])
    assert r["paired"] == pytest.approx([0.1, 0.1, 0.0])
    assert r["median"] == pytest.approx(0.1)
    assert r["ratio_of_medians"] == pytest.approx(1.1 / 1.0 - 1)


def _drift_run(scenario, mode, acceptance, draft_s=math.nan, seed=0):
    n = len(acceptance)
    return {"scenario": scenario, "mode": mode, "seed": seed, "steps": n, "per_step": {
        "step": list(range(n)), "spec/mean_acceptance_length": acceptance, "time/step": [2.0] * n,
        "draft/seconds": [draft_s] * n, "reward": [0.5] * n, "drift/kl_to_warmstart": [0.01 * i for i in range(n)]}}


def test_drift_compares_cotrained_with_frozen_per_seed_from_the_first_update_on():
    from benchmarks.drift import summarise_scenario

    runs = {"same_task/cotrained/seed0": _drift_run("same_task", "cotrained", [1.0] + [3.0] * 9, draft_s=0.5),
            "same_task/frozen/seed0": _drift_run("same_task", "frozen", [3.0] + [2.0] * 9),
            "same_task/cotrained/seed1": _drift_run("same_task", "cotrained", [3.0] * 10, draft_s=0.5, seed=1)}
    s = summarise_scenario(runs, "same_task")
    assert s["seeds"] == [0]  # seed 1 has no frozen run yet
    assert s["acceptance_end"] == {"cotrained": 3.0, "frozen": 2.0}
    assert s["cotrained_over_frozen_end"]["median"] == pytest.approx(1.5)
    assert s["min_cotrained_over_frozen_after_first_update"] == pytest.approx(1.5)  # step 0 left out
    assert s["min_cotrained_acceptance"] == pytest.approx(3.0)
    assert s["draft_share_of_step"] == pytest.approx(0.25)
    assert s["drift_end"]["drift/kl_to_warmstart"]["frozen"] == pytest.approx(0.09)
    assert summarise_scenario(runs, "domain_shift") is None


def test_drift_speed_is_the_spread_over_steps_after_the_first():
    from benchmarks.drift import summarise_speed

    per_step = lambda tok_s, step_s: {"rollout/tokens_per_s": tok_s, "time/step": step_s}  # noqa: E731
    runs = {"deep/none/seed0": {"per_step": per_step([1.0, 100, 100, 100], [9.0, 2, 2, 2])},
            "deep/cotrained/seed0": {"per_step": {**per_step([1.0, 150, 160, 170], [9.0, 1, 2, 3]),
                                                  "draft/seconds": [0.1, 0.1, 0.2, 0.3],
                                                  "spec/mean_acceptance_length": [2.0, 2.5, 3.0, 3.0]}}}
    s = summarise_speed(runs)
    assert s["cotrained"]["rollout_tokens_per_s"] == {"median": 160, "q1": 155, "q3": 165}
    assert s["cotrained"]["draft_share_of_step"] == pytest.approx(0.1)
    assert s["vs_none"]["cotrained"] == {"step_seconds": 1.0, "rollout_tokens_per_s": 1.6}
    assert "frozen" not in s


@pytest.mark.slow
def test_drift_study_end_to_end_writes_after_every_run_and_resumes(tmp_path, capsys):
    """Both scenarios, tiny: the second call keeps the finished same_task runs and adds the domain shift."""
    import json

    from tests.helpers import TINY

    out, work = tmp_path / "out", tmp_path / "work"
    common = ["steps=2", "speed_steps=0", f"out={out}", f"work={work}", *TINY]
    assert cli.main(["bench", "drift", "scenarios=same_task", *common]) == 0
    first = json.loads((out / "drift.json").read_text())
    assert set(first["runs"]) == {"same_task/cotrained/seed0", "same_task/frozen/seed0"}
    assert cli.main(["bench", "drift", "resume=true", *common]) == 0
    assert "same_task/cotrained/seed0: in " in capsys.readouterr().out
    data = json.loads((out / "drift.json").read_text())
    assert set(data["summary"]["scenarios"]) == {"same_task", "domain_shift"}
    assert data["runs"]["same_task/frozen/seed0"] == first["runs"]["same_task/frozen/seed0"]
    for run in data["runs"].values():
        per_step = run["per_step"]
        assert per_step["step"] == [1, 2]  # trainer.global_step after each step
        for key in ("drift/kl_to_warmstart", "drift/feature_shift", "drift/response_len", "reward", "time/step",
                    "spec/mean_acceptance_length", "spec/pos_0_rate"):
            assert all(math.isfinite(v) for v in per_step[key]), (run["scenario"], run["mode"], key)
        assert per_step["drift/kl_to_warmstart"][1] > 0
    assert all(math.isfinite(v) for v in data["runs"]["domain_shift/cotrained/seed0"]["per_step"]["draft/loss"])
    shifted = json.loads((work / "warmstarts/domain_shift_seed0/home_task/draft/meta.json").read_text())
    assert shifted["settings"]["toy"]["digits"] == 2  # the draft never saw the RL task (3 digits)
    for name in ("drift.md", "drift.png", "drift_policy.png"):
        assert (out / name).is_file(), name
    assert "domain_shift" in (out / "drift.md").read_text()


def test_adaptive_live_buckets_cover_every_batch_size_once():
    from benchmarks.adaptive import LIVE_BUCKET_EDGES, live_bucket

    assert [live_bucket(n) for n in (1, 2, 3, 4, 5, 32, 33, 500)] == \
        ["1-2", "1-2", "3-4", "3-4", "5-8", "17-32", "33+", "33+"]
    assert len({live_bucket(n) for n in range(1, 100)}) == len(LIVE_BUCKET_EDGES) + 1


def test_adaptive_toy_reward_is_the_share_of_even_tokens():
    from benchmarks.adaptive import even_token_share

    assert even_token_share([2, 3, 4, 5], "") == 0.5
    assert even_token_share([], "") == 0.0


def test_adaptive_token_ids_tokenizer_has_what_the_grpo_rollout_reads():
    """`bench adaptive`'s GRPO runs hand GRPOModule a tokenizer over token-id prompts: every member the rollout path
    reads (PromptTokenizer's encode_prompt, decode, eos_id, stop_ids) must be there (a missing encode_prompt once
    failed the benchmark at its first GRPO step)."""
    from benchmarks.adaptive import TokenIds
    from spectrain.config import load_config
    from spectrain.train.module import sampling_config

    tokenizer = TokenIds(eos_id=2)
    assert tokenizer.encode_prompt([1, 5, 6]) == [1, 5, 6] and tokenizer.decode([7, 8]) == [7, 8]
    sampling = sampling_config(load_config("tiny_cpu"), tokenizer, n=4)
    assert sampling.n == 4 and sampling.stop_token_ids == ()  # EOS is the engine's own stop


def test_config_errors_are_spectrain_errors():
    """The CLI prints a `SpecTrainError` as one line: the benchmarks' option errors must be one."""
    from benchmarks.common import parse_options

    with pytest.raises(ConfigError, match="unknown option"):
        parse_options("x", ["nope=1"], {"steps": 1})


def test_live_bytes_counts_new_storages_once_until_freed():
    """Views and in-place results share their input's storage: only fresh allocations count, until freed."""
    from benchmarks.memory import LiveBytes

    x = torch.zeros(1000)  # live before: never counted
    with LiveBytes() as live:
        y = x * 2
        view = y.view(10, 100).t()
        y.add_(1)
        x.view(-1).mul_(3)
        assert live.live == live.peak == 4000
        del y
        assert live.live == 4000  # the view keeps the storage
        del view
        z = x + 1
        assert live.live == 4000 and live.peak == 4000
    del z
    assert live.live == 0


def test_bench_memory_quick_writes_the_report_and_micro_batches_cap_the_peak(tmp_path):
    """`spectrain bench memory quick=true`: tiny sizes, every (scale, mode) in its own process."""
    assert cli.main(["bench", "memory", "quick=true", f"out_dir={tmp_path}"]) == 0
    for name in ("memory.json", "memory.md", "memory.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "memory.json").read_text())
    headline = data["headline"]
    assert {"peak_ratio_16x_over_1x", "peak_ratio_16x_over_1x_before", "planner_relative_error"} <= set(headline)
    largest = max(data["options"]["scales"])
    peak = {p["mode"]: p["peak_bytes"] for p in data["points"] if p["scale"] == largest}
    assert 0 < peak["after"] < peak["before"]


# bench speedup ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (("modes=none,turbo",), "bench speedup: modes='none,turbo': unknown turbo; choose from none, frozen, cotrained"),
    (("modes=frozen,cotrained",), "bench speedup: modes must include none, the baseline every ratio divides by"),
    (("ks=1,5",), r"bench speedup: ks='1,5': each fixed k must be in 1..3"),
    (("steps=1",), "bench speedup: steps=1 rounds=3: give steps >= 2"),
    (("tiny_cpu", "draft.mode=fast"), "bench speedup: draft.mode: 'fast' is not one of"),
])
def test_speedup_refuses_bad_options_before_any_run(capsys, args, message):
    code, err = _bench(capsys, "speedup", *args)
    assert code == 2 and err.startswith(f"error: {message}"), err


def test_speedup_modes_and_their_overrides():
    from benchmarks.speedup import mode_overrides, parse, round_order

    options, overrides = parse(["tiny_cpu_concurrency", "ks=1,4", "steps=3", "rollout.n=2"])
    assert (options["recipe"], options["steps"], overrides) == ("tiny_cpu_concurrency", 3, ["rollout.n=2"])
    assert options["modes"] == "none,frozen,cotrained,concurrency,bandit,cotrained_k1"  # 4 is the recipe's own k
    modes = options["modes"].split(",")
    assert round_order(modes, 0) == modes and round_order(modes, 2)[:2] == ["cotrained", "concurrency"]
    assert mode_overrides("cotrained_k1", 4, None)[-1] == "draft.num_speculative_tokens=1"
    assert mode_overrides("bandit", 3, 40) == ["draft.mode=cotrained", "speculation.mode=bandit",
                                               "speculation.verify_budget=40", "speculation.bandit.arms=[1,2,3]"]
    assert mode_overrides("none", 3, 40) == ["draft.mode=none", "speculation.mode=fixed"]


def speedup_run(step_seconds: list[float], rollout_seconds: float, tokens: float, reward: float,
                acceptance: float | None = None, draft: float | None = None) -> dict:
    n = len(step_seconds)
    nan = [math.nan] * n
    return {"per_step": {"step": list(range(1, n + 1)), "reward": [reward] * n, "time/step": step_seconds,
                         "rollout/seconds": [rollout_seconds] * n,
                         "rollout/tokens_per_s": [tokens / rollout_seconds] * n,
                         "draft/seconds": [draft] * n if draft else nan, "time/weight_sync": [0.01] * n,
                         "spec/mean_acceptance_length": [acceptance] * n if acceptance else nan, "spec/k_mean": nan}}


def test_speedup_summary_pairs_rounds_and_skips_each_runs_first_step():
    from benchmarks.speedup import markdown, summarise

    runs = {"none": [speedup_run([9.0, 1.0, 1.0, 1.0], 0.5, 100, 0.5), speedup_run([9.0, 2.0, 2.0], 1.0, 100, 0.5)],
            "cotrained": [speedup_run([9.0, 0.5, 0.5, 0.5], 0.25, 100, 0.5, 3.0, 0.1),
                          speedup_run([9.0, 4.0, 4.0], 2.0, 100, 0.5, 3.0, 0.1)],
            "concurrency": [speedup_run([9.0, 0.4, 0.4, 0.4], 0.2, 100, 0.5, 3.2, 0.1),
                            speedup_run([9.0, 5.0, 5.0], 2.5, 100, 0.5, 3.2, 0.1)]}
    s = summarise(runs)
    h = s["headline"]
    assert h["e2e_cotrained_over_none"]["runs"] == [2.0, 0.5]  # round 1: 1.0 / 0.5; round 2: 2.0 / 4.0
    assert h["rollout_cotrained_over_none"]["runs"] == [2.0, 0.5]
    assert h["adaptive_over_best_fixed_k"]["runs"] == [0.5 / 0.4, 4.0 / 5.0]
    assert "cotrained_over_frozen" not in h  # no frozen mode ran
    m = s["modes"]["cotrained"]
    assert m["draft_share"]["median"] == pytest.approx((0.2 + 0.025) / 2)
    assert m["acceptance_length"]["median"] == 3.0 and "acceptance_length" not in s["modes"]["none"]
    assert m["reward_vs_none"]["difference"] == 0.0
    text = markdown({"summary": s, "options": {"recipe": "tiny_cpu", "steps": 4}, "command": "c", "machine": "m"})
    assert "| end-to-end step speed, co-trained / none (`e2e_cotrained_over_none`) | **1.25x** (1.25x faster" in text
    assert "(`adaptive_over_best_fixed_k`) | **1.02x** (1.02x faster; 0.80..1.25) |" in text


def test_speedup_writes_a_slowdown_as_a_slowdown():
    from benchmarks.speedup import ratio_text

    assert ratio_text({"median": 0.5, "min": 0.4, "max": 0.6}) == "**0.50x** (2.00x slower; 0.40..0.60)"


@pytest.mark.slow
def test_bench_speedup_end_to_end_writes_the_report(tmp_path):
    """Two rounds of none and co-trained, tiny: every run timed after its first step, the headlines paired."""
    from tests.helpers import TINY

    out, work = tmp_path / "out", tmp_path / "work"
    assert cli.main(["bench", "speedup", "tiny_cpu", "steps=2", "rounds=2", "modes=none,cotrained", "ks=",
                     f"out={out}", f"work={work}", *TINY]) == 0
    data = json.loads((out / "speedup.json").read_text())
    assert [r["round"] for r in data["runs"]["none"]] == [0, 1] and set(data["runs"]) == {"none", "cotrained"}
    ratio = data["summary"]["headline"]["e2e_cotrained_over_none"]
    steps = {m: [r["per_step"]["time/step"][1] for r in runs] for m, runs in data["runs"].items()}
    assert ratio["runs"] == pytest.approx([n / c for n, c in zip(steps["none"], steps["cotrained"])])
    assert data["headline"]["rollout_cotrained_over_none"] > 0
    assert data["summary"]["modes"]["cotrained"]["acceptance_length"]["median"] > 1
    assert all(r["speed"]["rollout_tokens_per_s"] > 0 for runs in data["runs"].values() for r in runs)
    assert (out / "speedup.png").is_file() and "e2e_cotrained_over_none" in (out / "speedup.md").read_text()


# bench cotraining_cost -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (("variants=every_step,turbo",), "bench cotraining_cost: variants='every_step,turbo': unknown turbo; choose from "
                                     "none, frozen, every_step"),
    (("steps=2",), "bench cotraining_cost: steps=2 rounds=2: give steps >= 3"),
    (("tiny_cpu", "draft.hold_tolerance=1.5"), "bench cotraining_cost: draft.hold_tolerance: is 1.5; it must be in"),
])
def test_cotraining_cost_refuses_bad_options_before_any_run(capsys, args, message):
    code, err = _bench(capsys, "cotraining_cost", *args)
    assert code == 2 and err.startswith(f"error: {message}"), err


def test_cotraining_cost_counts_steps_without_an_update_in_the_draft_share():
    from benchmarks.cotraining_cost import markdown, summarise

    def run(step_seconds, draft_seconds, acceptance):
        n = len(step_seconds)
        return {"per_step": {"step": list(range(1, n + 1)), "reward": [0.5] * n, "time/step": step_seconds,
                             "draft/seconds": draft_seconds,
                             "draft/updated": [0.0 if math.isnan(d) else 1.0 for d in draft_seconds],
                             "spec/mean_acceptance_length": acceptance}}

    nan = math.nan
    runs = {"none": [run([9.0, 2.0, 2.0, 2.0, 2.0], [nan] * 5, [nan] * 5)],
            "every_step": [run([9.0, 4.0, 4.0, 4.0, 4.0], [1.0] * 5, [3.0, 3.0, 3.0, 3.5, 3.5])],
            "every_2": [run([9.0, 4.0, 2.0, 4.0, 2.0], [1.0, 2.0, nan, 2.0, nan], [3.0, 3.0, 3.0, 3.0, 2.0])]}
    s = summarise(runs)["variants"]
    assert s["every_step"]["draft_share"]["median"] == pytest.approx(0.25)  # timed steps: 4 s of 16 s
    assert s["every_2"]["draft_share"]["median"] == pytest.approx(4.0 / 12.0)  # no-update steps count as 0 s
    assert s["every_2"]["updates_per_step"]["median"] == 0.5
    assert s["every_step"]["late_acceptance_length"]["median"] == 3.5  # the timed steps' second half
    assert s["every_2"]["speed_over_every_step"]["runs"] == [4.0 / 3.0]  # step means 3 s against 4 s
    assert s["every_step"]["speed_over_none"]["runs"] == [0.5] and "acceptance_length" not in s["none"]
    text = markdown({"summary": {"rounds": 1, "variants": s}, "options": {"recipe": "tiny_cpu", "steps": 5},
                     "command": "c", "machine": "m"})
    assert "| every_2 | `draft.mode=cotrained draft.every_n_steps=2` | 3.00 (3.00..3.00) | 33 (33..33)% |" in text
    assert "**0.50x** (2.00x slower; 0.50..0.50)" in text


@pytest.mark.slow
def test_bench_cotraining_cost_end_to_end_writes_the_report(tmp_path):
    """One round of none, every-step and held co-training, tiny: the report holds each variant's cost."""
    from tests.helpers import TINY

    out, work = tmp_path / "out", tmp_path / "work"
    assert cli.main(["bench", "cotraining_cost", "tiny_cpu", "steps=3", "rounds=1", "variants=none,every_step,hold",
                     f"out={out}", f"work={work}", *TINY]) == 0
    data = json.loads((out / "cotraining_cost.json").read_text())
    v = data["summary"]["variants"]
    assert v["every_step"]["updates_per_step"]["median"] == 1.0 and 0 < v["every_step"]["draft_share"]["median"] < 1
    assert 0 <= v["hold"]["updates_per_step"]["median"] <= 1 and v["none"]["draft_share"]["median"] == 0
    assert v["every_step"]["acceptance_length"]["median"] > 1
    assert (out / "cotraining_cost.png").is_file() and "| hold |" in (out / "cotraining_cost.md").read_text()


# bench regime ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (("sizes=4x100",), "bench regime: sizes: '4x100' is not LAYERSxHIDDEN with LAYERS >= 4"),
    (("sizes=2x64",), "bench regime: sizes: '2x64' is not LAYERSxHIDDEN with LAYERS >= 4 (the EAGLE-3 draft taps"),
    (("k=0",), "bench regime: k=0: it must be >= 1"),
    (("dtype=float16",), "bench regime: dtype=float16: use one of"),
])
def test_regime_refuses_bad_options_before_any_work(capsys, args, message):
    code, err = _bench(capsys, "regime", *args)
    assert code == 2 and err.startswith(f"error: {message}"), err


@pytest.mark.slow
def test_bench_regime_decodes_at_full_agreement_and_writes_the_map(tmp_path):
    """The always-agreeing target and draft reach acceptance k+1 in real vLLM; the report has every cell."""
    out = tmp_path / "out"
    assert cli.main(["bench", "regime", "sizes=4x128", "concurrency=1,2", "new_tokens=16", "repeats=1",
                     f"out={out}", f"work={tmp_path / 'work'}"]) == 0
    data = json.loads((out / "regime.json").read_text())
    [size] = data["sizes"]
    assert [p["concurrency"] for p in size["points"]] == [1, 2]
    for p in size["points"]:
        assert p["acceptance_length"] > 3.9 and p["speedup"]["median"] > 0  # measured 4.00: nothing rejected
    assert "| 4 x 128 |" in (out / "regime.md").read_text() and (out / "regime.png").is_file()


# bench rollout_scaling -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (("steps=1",), "bench rollout_scaling: steps=1 rounds=2: give steps >= 2"),
    (("rollout.tensor_parallel_size=3",), "bench rollout_scaling: rollout.tensor_parallel_size: is 3, which does not "
                                          "divide the 2 ranks"),
    (("rollout.prompts_per_step=1",), "bench rollout_scaling: rollout.prompts_per_step=1: give at least 2"),
])
def test_rollout_scaling_refuses_bad_options_before_any_work(capsys, args, message):
    code, err = _bench(capsys, "rollout_scaling", *args)
    assert code == 2 and err.startswith(f"error: {message}"), err


def test_rollout_scaling_summary_pairs_the_rounds():
    from benchmarks.rollout_scaling import summarise

    def run(tokens_per_s: float, step_s: float) -> dict:
        nan = float("nan")
        return {"per_step": {"reward": [0.5, 0.5, 0.5], "time/step": [9.0, step_s, step_s],
                             "rollout/seconds": [9.0, 0.5, 0.5],
                             "rollout/tokens_per_s": [1.0, tokens_per_s, tokens_per_s],
                             "draft/seconds": [nan, 0.2, 0.2], "time/weight_sync": [0.1, 0.1, 0.1],
                             "spec/mean_acceptance_length": [3.0, 3.0, 3.0], "rollout/max_running": [64, 64, 64]}}

    s = summarise({"rank0": [run(1000, 2.0), run(1200, 2.0)], "all": [run(1800, 1.6), run(1800, 1.6)],
                   "rank0_half": [run(800, 1.2), run(900, 1.2)]})
    assert s["rounds"] == 2 and s["headline"]["two_engines_over_one"]["runs"] == [1.8, 1.5]
    assert s["headline"]["half_batch_ceiling"]["runs"] == [1.6, 1.5]  # 2 x one engine at half the batch / rank0
    assert s["headline"]["step_two_engines_over_one"]["median"] == pytest.approx(1.25)
    split = s["layouts"]["all"]
    assert split["rollout_share"]["median"] == pytest.approx(0.5 / 1.6)
    total = sum(split[f"{k}_share"]["median"] for k in ("rollout", "policy", "draft", "sync"))
    assert total == pytest.approx(1.0)

"""`training.png` (RunHistory): which panels a run gets, their data, the EMA, and that the figure is written."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from spectrain.callbacks import HeldOutEval, RunHistory
from spectrain.callbacks.run_history import run_speed, speed_line
from spectrain.plots import ema, plot_grid, plot_panels, smoothing_alpha

ALL_TITLES = ["reward", "policy loss", "KL to reference", "clip fraction", "draft loss", "mean acceptance length",
              "rollout tokens/s", "step time split"]


def run_rows(steps: int, draft: bool = True) -> list[dict]:
    """Rows as a real run's RunHistory records them (the metrics of GRPOModule.log_step and the callbacks)."""
    rows = []
    for step in range(1, steps + 1):
        tokens, seconds = 2000.0 + 10 * step, 0.8
        row = {"step": step, "epoch": 0.0, "reward": 0.1 + 0.01 * step, "policy/loss": 0.05 * (-1) ** step,
               "policy/kl": 0.001 * step, "policy/clip_fraction": 0.01, "policy/grad_norm": 0.5,
               "policy/lr": 3e-5, "rollout/seconds": seconds, "rollout/tokens_per_s": tokens / seconds,
               "rollout/mean_response_len": 16.0, "time/step": 1.5, "time/weight_sync": 0.05,
               "sync/mismatches": 0.0}
        if draft:
            row.update({"draft/loss": 6.5 - 0.01 * step, "draft/seconds": 0.3, "draft/lr": 1e-4,
                        "spec/mean_acceptance_length": 1.2 + 0.01 * step, "spec/acceptance_rate": 0.08})
        rows.append(row)
    return rows


def history(rows: list[dict], **kwargs) -> RunHistory:
    callback = RunHistory(**kwargs)
    callback.history = rows
    return callback


def by_title(panels) -> dict:
    return {p.title: p for p in panels}


def held_out_eval(points: list[dict]) -> HeldOutEval:
    callback = HeldOutEval(examples=[], every_n_steps=1, samples=1)
    callback.history = points
    return callback


def test_a_run_with_a_draft_gets_every_panel_in_order():
    assert [p.title for p in history(run_rows(5)).panels(None, 3)] == ALL_TITLES


def test_without_a_draft_there_is_no_draft_loss_or_acceptance_panel():
    titles = [p.title for p in history(run_rows(5, draft=False)).panels(None, 3)]
    assert titles == [t for t in ALL_TITLES if t not in ("draft loss", "mean acceptance length")]
    split = by_title(history(run_rows(5, draft=False)).panels())["step time split"]
    assert [c.label for c in split.curves] == ["rollout", "policy training", "weight sync", "step total"]


def test_a_metric_logged_only_as_nan_leaves_its_panel_out():
    rows = run_rows(4)
    for row in rows:
        row["draft/loss"] = math.nan
    assert "draft loss" not in [p.title for p in history(rows).panels(None, 3)]


def test_nan_rows_are_dropped_from_a_series():
    rows = run_rows(5)
    rows[1]["draft/loss"] = rows[3]["draft/loss"] = math.nan  # steps 2 and 4: the draft skipped them
    curve = by_title(history(rows).panels(None, 3))["draft loss"].curves[0]
    assert curve.xs == [1, 3, 5]
    assert curve.ys == [rows[0]["draft/loss"], rows[2]["draft/loss"], rows[4]["draft/loss"]]
    assert curve.style == "smoothed"


def test_acceptance_ceiling_is_k_plus_one_and_the_axis_starts_at_one():
    panel = by_title(history(run_rows(5)).panels(None, 3))["mean acceptance length"]
    assert panel.ceiling == 4.0 and panel.ymin == 1.0 and panel.ymax > 4.0
    unknown_k = by_title(history(run_rows(5)).panels(None, None))["mean acceptance length"]
    assert unknown_k.ceiling is None and unknown_k.ymin == 1.0


def test_tokens_per_second_is_generated_tokens_over_rollout_seconds():
    rows = run_rows(3)
    curve = by_title(history(rows).panels())["rollout tokens/s"].curves[0]
    assert curve.xs == [1, 2, 3]
    assert curve.ys == pytest.approx([(2000.0 + 10 * s) / 0.8 for s in (1, 2, 3)])


def test_step_time_split_stacks_to_the_step_time():
    rows = run_rows(3)
    rows[1]["draft/seconds"] = math.nan  # a step the draft did not train: its part counts 0 there
    curves = {c.label: c for c in by_title(history(rows).panels())["step time split"].curves}
    assert [label for label in curves] == ["rollout", "policy training", "draft update", "weight sync", "step total"]
    assert curves["draft update"].ys == [0.3, 0.0, 0.3]
    assert curves["policy training"].ys == pytest.approx([1.5 - 0.8 - 0.3 - 0.05, 1.5 - 0.8 - 0.05, 0.35])
    stacked = [sum(c.ys[i] for c in curves.values() if c.style == "stacked") for i in range(3)]
    assert stacked == pytest.approx(curves["step total"].ys)


def test_a_held_out_evaluation_after_a_step_is_stacked_on_its_bar():
    held_out = held_out_eval([{"step": 0, "greedy_reward": 0.2, "sampled_reward": 0.15},  # the warm start's: untimed
                              {"step": 2, "greedy_reward": 0.3, "sampled_reward": 0.2, "seconds": 0.7}])
    curves = {c.label: c for c in by_title(history(run_rows(3)).panels(held_out))["step time split"].curves}
    assert curves["held-out eval"].ys == [0.0, 0.7, 0.0] and curves["held-out eval"].style == "stacked"
    assert curves["step total"].ys == [1.5, 1.5, 1.5]  # `time/step` excludes the evaluation


def test_run_speed_sums_the_parts_by_hand():
    rows = run_rows(3)
    rows[1]["draft/seconds"] = math.nan
    rows[0].update({"spec/speedup_estimate": 1.4, "time/speedup_probe": 0.5})
    rows[2].update({"spec/speedup_estimate": 1.2, "time/speedup_probe": 0.5})
    speed = run_speed(rows, [{"step": 0, "greedy_reward": 0.2}, {"step": 2, "greedy_reward": 0.3, "seconds": 0.7}])
    tokens = 2010 + 2020 + 2030
    assert speed["generated_tokens"] == tokens and speed["rollout_tokens_per_s"] == pytest.approx(2525.0)
    assert speed["mean_acceptance_length"] == pytest.approx(1.22)
    assert speed["speedup_estimate"] == 1.4  # the median of two: the upper one
    want = {"rollout": 2.4, "draft": 0.6, "sync": 0.15, "policy": 4.5 - 2.4 - 0.6 - 0.15, "eval": 0.7,
            "speedup_probe": 1.0}
    assert speed["seconds"] == pytest.approx(want)
    assert speed["share"] == pytest.approx({k: v / 6.2 for k, v in want.items()}, abs=1e-3)
    line = speed_line(speed)
    assert line == ("[spectrain] speed: rollout 2525.0 tok/s; acceptance length 1.22; speculation speedup 1.4x "
                    "(probe); time: rollout 39%, policy 22%, draft 10%, sync 2%, eval 11%, speedup_probe 16%"), line


def test_run_speed_of_a_run_without_a_draft_or_rollouts_has_no_acceptance_or_rate():
    speed = run_speed([{"step": 1, "time/step": 2.0}], [])
    assert speed["rollout_tokens_per_s"] is None and speed["mean_acceptance_length"] is None
    assert speed["seconds"]["policy"] == 2.0 and speed["share"]["policy"] == 1.0
    assert speed_line(speed).endswith("time: policy 100%")


def test_reward_panel_has_the_held_out_points_as_markers():
    held_out = held_out_eval([{"step": 0, "greedy_reward": 0.2, "sampled_reward": 0.15},
                              {"step": 4, "greedy_reward": 0.3, "sampled_reward": math.nan}])
    curves = {c.label: c for c in by_title(history(run_rows(4)).panels(held_out, 3))["reward"].curves}
    assert curves["train rollouts"].style == "smoothed" and curves["train rollouts"].xs == [1, 2, 3, 4]
    assert (curves["held-out, greedy"].xs, curves["held-out, greedy"].ys) == ([0, 4], [0.2, 0.3])
    assert (curves["held-out, sampled"].xs, curves["held-out, sampled"].style) == ([0], "markers")


def test_ema_against_a_hand_computation():
    assert ema([1.0, 2.0, 3.0, 0.0], 0.5) == pytest.approx([1.0, 1.5, 2.25, 1.125])
    assert ema([4.0, 8.0], 1.0) == [4.0, 8.0]
    assert ema([], 0.3) == []


def test_smoothing_window_grows_with_the_run():
    assert smoothing_alpha(3) == 1.0  # too short to smooth
    assert smoothing_alpha(100) == pytest.approx(2 / 11)  # window of 10 steps


def test_plot_writes_a_png(tmp_path):
    rows = run_rows(30)
    rows[5]["policy/kl"] = math.nan
    held_out = held_out_eval([{"step": 0, "greedy_reward": 0.2, "sampled_reward": 0.15}])
    path = history(rows).plot(tmp_path / "run" / "training.png", held_out=held_out, num_speculative_tokens=3)
    assert path.exists() and path.stat().st_size > 0


def test_on_train_end_takes_k_from_the_config_and_draws_training_png(tmp_path):
    callback = history(run_rows(3))
    trainer = SimpleNamespace(is_global_zero=True, callbacks=[callback], default_root_dir=str(tmp_path))
    module = SimpleNamespace(config=SimpleNamespace(draft=SimpleNamespace(num_speculative_tokens=5)))
    assert callback._speculative_tokens(module) == 5
    assert RunHistory(num_speculative_tokens=2)._speculative_tokens(module) == 2
    callback.on_train_end(trainer, module)
    assert (tmp_path / "training.png").stat().st_size > 0


def test_plot_panels_keeps_drawing_one_row(tmp_path):
    path = plot_panels(tmp_path / "row.png", "t", [("y", {"a": ([1, 2], [3.0, 4.0])}), ("z", {"b": ([1], [1.0])})])
    assert path.stat().st_size > 0


def test_plot_grid_leaves_spare_cells_blank(tmp_path):
    panels = history(run_rows(3, draft=False)).panels()
    assert len(panels) == 6
    assert plot_grid(tmp_path / "grid.png", "t", panels, columns=4).stat().st_size > 0

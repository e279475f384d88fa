"""The console: one plain line per step in a log, a bar named for GRPO steps without `v_num`, `--verbose`."""
import os
from types import SimpleNamespace

import torch

from spectrain import console
from spectrain.cli import build_parser
from spectrain.train.progress import PlainProgress, SpecProgressBar


def test_step_line_shows_the_bar_numbers_it_has():
    metrics = {"reward_mean": torch.tensor(0.01734), "accept_len": 1.2812, "time/step": 1.4567, "other": 3.0}
    assert console.step_line(3, 60, metrics) == "step 3/60  reward 0.0173  accept len 1.28  s/step 1.46"
    assert console.step_line(1, 2, {}) == "step 1/2"


def test_plain_progress_prints_every_n_steps_and_the_last(capsys):
    progress = PlainProgress(every_n_steps=2)
    for step in range(1, 6):
        trainer = SimpleNamespace(global_step=step, max_steps=5, is_global_zero=True,
                                  callback_metrics={"reward_mean": 0.5})
        progress.on_train_batch_end(trainer, None, None, None, 0)
    assert capsys.readouterr().out.splitlines() == ["step 2/5  reward 0.5", "step 4/5  reward 0.5",
                                                    "step 5/5  reward 0.5"]


def test_the_bar_counts_grpo_steps_without_v_num(monkeypatch):
    bar = SpecProgressBar()
    assert bar._get_train_description(0) == "GRPO steps"
    monkeypatch.setattr("lightning.pytorch.callbacks.RichProgressBar.get_metrics",
                        lambda self, trainer, module: {"v_num": 0, "reward_mean": 0.5})
    assert bar.get_metrics(None, None) == {"reward_mean": 0.5}


def test_verbose_is_accepted_before_and_after_the_command(monkeypatch):
    parser = build_parser()
    assert parser.parse_args(["--verbose", "fit", "tiny_cpu"]).verbose
    assert parser.parse_args(["fit", "tiny_cpu", "trainer.max_steps=1", "--verbose"]).verbose
    assert not parser.parse_args(["fit", "tiny_cpu"]).verbose
    monkeypatch.setenv(console.VERBOSE_ENV, "0")  # restored after the test
    console.prepare(["fit", "--verbose"])
    assert console.verbose() and os.environ[console.VERBOSE_ENV] == "1"

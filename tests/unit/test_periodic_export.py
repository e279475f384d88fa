"""`PeriodicExport`'s folders: complete or absent, pruned to the newest `keep`, and a resume's re-run steps removed."""
from types import SimpleNamespace

import pytest

from spectrain.callbacks import PeriodicExport
from spectrain.callbacks.periodic_export import exported_steps


def write_export(out_dir):
    if out_dir is not None:
        (out_dir / "policy").mkdir(parents=True)
        (out_dir / "policy" / "config.json").write_text("{}")


def run_steps(callback, steps, start=0, rank_zero=True):
    trainer = SimpleNamespace(global_step=start, is_global_zero=rank_zero)
    callback.on_train_start(trainer, None)
    for step in steps:
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None, None, None, 0)


def test_every_n_steps_with_the_newest_kept(tmp_path):
    run_steps(PeriodicExport(tmp_path, every_n_steps=2, export=write_export, keep=2), range(1, 8))
    assert exported_steps(tmp_path) == [4, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000006"]  # no .partial left
    assert (tmp_path / "step_000006" / "policy" / "config.json").is_file()


def test_keep_all_and_a_resume_removes_the_steps_it_re_runs(tmp_path):
    run_steps(PeriodicExport(tmp_path, every_n_steps=1, export=write_export), range(1, 6))
    assert exported_steps(tmp_path) == [1, 2, 3, 4, 5]
    run_steps(PeriodicExport(tmp_path, every_n_steps=1, export=write_export), [], start=3)  # resumed from step 3
    assert exported_steps(tmp_path) == [1, 2, 3]


def test_a_failed_export_leaves_only_a_partial_folder_that_the_next_try_replaces(tmp_path):
    def fail(out_dir):
        write_export(out_dir)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run_steps(PeriodicExport(tmp_path, every_n_steps=1, export=fail), [1])
    assert exported_steps(tmp_path) == [] and (tmp_path / "step_000001.partial").is_dir()
    run_steps(PeriodicExport(tmp_path, every_n_steps=1, export=write_export), [1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


def test_other_ranks_take_part_without_writing(tmp_path):
    calls = []
    run_steps(PeriodicExport(tmp_path, every_n_steps=1, export=calls.append), [1, 2], rank_zero=False)
    assert calls == [None, None] and not tmp_path.joinpath("step_000001").exists()

"""`spectrain eval`'s numbers and inputs: pass@k against the combinatorial definition, and what it refuses."""
import itertools
import math

import pytest

from spectrain.cli import build_parser
from spectrain.cli import main as cli_main
from spectrain.config import load_config, to_yaml
from spectrain.errors import ConfigError
from spectrain.evaluate import ks_for, mean_and_se, pass_at_k, resolve


@pytest.mark.parametrize("n, c, k", [(1, 0, 1), (1, 1, 1), (4, 1, 1), (4, 1, 2), (4, 2, 3), (5, 0, 5), (8, 3, 4),
                                     (8, 7, 2), (16, 5, 8)])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_correct_one(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_ks_and_standard_errors():
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]
    assert mean_and_se([1.0, 0.0, 1.0, 0.0]) == pytest.approx((0.5, math.sqrt(1 / 3) / 2))
    assert mean_and_se([0.25]) == (0.25, 0.0)


def test_resolve_finds_final_then_the_newest_export(tmp_path):
    run = tmp_path / "run"
    (run / "exports" / "step_000002" / "policy").mkdir(parents=True)
    (run / "exports" / "step_000002" / "policy" / "config.json").write_text("{}")
    (run / "exports" / "step_000010" / "policy").mkdir(parents=True)
    (run / "exports" / "step_000010" / "policy" / "config.json").write_text("{}")
    (run / "config.yaml").write_text("{}")
    assert resolve(run) == (run / "config.yaml", run / "exports" / "step_000010")
    export = run / "exports" / "step_000002"
    assert resolve(export) == (run.resolve() / "config.yaml", export)
    (run / "final" / "policy").mkdir(parents=True)
    (run / "final" / "policy" / "config.json").write_text("{}")
    assert resolve(run) == (run / "config.yaml", run / "final")


def test_resolve_names_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"eval: .*nope is not a directory; give a run directory"):
        resolve(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"holds neither config\.yaml \(a run directory\) nor policy/config\.json"):
        resolve(tmp_path)
    (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(ConfigError, match=r"has no exported policy yet \(no final/, no exports/\): finish the run, "
                                          r"or set trainer\.export_every_n_steps"):
        resolve(tmp_path)
    orphan = tmp_path / "elsewhere" / "x"
    (orphan / "policy").mkdir(parents=True)
    (orphan / "policy" / "config.json").write_text("{}")
    (tmp_path / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"no config\.yaml in a directory above"):
        resolve(orphan)


def test_the_cli_refuses_a_missing_run_in_one_line(tmp_path, capsys):
    assert cli_main(["eval", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: eval: ") and "is not a directory" in err[0]


def test_an_override_after_val_files_is_read_as_an_override(tmp_path, capsys):
    """`eval RUN --val-files val.jsonl key=value`: the key=value is an override of the run's config, not a file."""
    run = tmp_path / "run"
    (run / "final" / "policy").mkdir(parents=True)
    (run / "final" / "policy" / "config.json").write_text("{}")
    (run / "config.yaml").write_text(to_yaml(load_config("tiny_cpu", [])))
    val = tmp_path / "val.jsonl"
    val.write_text("")
    assert cli_main(["eval", str(run), "--val-files", str(val), "rollout.no_such_key=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the config refuses the override's key: it was read as one
    assert len(err) == 1 and "bad value for 'rollout.no_such_key'" in err[0], err
    assert cli_main(["eval", str(run), "--val-files", "eval.prompts=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --val-files: eval.prompts=8 names no prompt file; give the files first, e.g. "
                   "--val-files val.jsonl eval.prompts=8"]


def test_the_val_files_help_names_every_format_the_loader_reads():
    evaluate = build_parser()._subparsers._group_actions[0].choices["eval"]
    help_text = " ".join(evaluate.format_help().split())
    assert "(.jsonl, .json or .parquet)" in help_text  # what spectrain/tasks/sources.py reads


def test_a_final_export_that_was_interrupted_is_named_with_the_fix(tmp_path):
    """`final/` is written aside and renamed: an interrupted export leaves `final.partial/`, which eval names, and
    it never falls back silently to an older periodic export."""
    run = tmp_path / "run"
    (run / "final.partial" / "policy").mkdir(parents=True)
    (run / "final.partial" / "policy" / "config.json").write_text("{}")  # the weights were being written
    (run / "config.yaml").write_text("{}")
    with pytest.raises(ConfigError, match=r"^eval: the final export of .*run was interrupted \(final\.partial/ is "
                                          r"incomplete, there is no final/\): run the run's `spectrain fit` command "
                                          r"again, which resumes checkpoints/last\.ckpt and writes final/$"):
        resolve(run)
    (run / "exports" / "step_000002" / "policy").mkdir(parents=True)
    (run / "exports" / "step_000002" / "policy" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"writes final/; or evaluate its newest export, .*exports/step_000002$"):
        resolve(run)


def test_a_half_written_final_names_what_is_missing_not_the_install(tmp_path, monkeypatch, capsys):
    """A `final/` cut short (policy weights, no tokenizer, no draft: an older spectrain's interrupted export) is
    refused in one line naming the missing parts and the fix, before any engine starts on it."""
    from spectrain.evaluate import check_export
    from spectrain.tasks.tokenizer import save_tokenizer
    from spectrain.train.trainer import SpecTrainer

    def tripwire(self, *args):
        pytest.fail("the engine was started on an incomplete export")

    monkeypatch.setattr(SpecTrainer, "build_rollout_engine", tripwire)
    run = tmp_path / "run"
    policy = run / "final" / "policy"
    policy.mkdir(parents=True)
    (policy / "config.json").write_text("{}")
    (policy / "model.safetensors").write_bytes(b"weights")
    config = load_config("tiny_cpu", [])
    (run / "config.yaml").write_text(to_yaml(config))
    assert cli_main(["eval", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: eval: {run / 'final'} is incomplete: no tokenizer in policy/ (tokenizer.json or "
                   f"tokenizer_config.json), no draft/config.json (the run trains a draft: draft.mode=cotrained); run "
                   f"the run's `spectrain fit` command again: it resumes checkpoints/last.ckpt and writes final/ anew"]
    save_tokenizer(policy)
    (run / "final" / "draft").mkdir()
    (run / "final" / "draft" / "config.json").write_text("{}")
    check_export(run / "final", config)  # complete now
    (policy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"is incomplete: no policy/\*\.safetensors \(the weights\); run the run's"):
        check_export(run / "final", config)

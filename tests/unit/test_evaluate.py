"""`spectrain eval`'s numbers and inputs: pass@k against the combinatorial definition, and what it refuses."""
import itertools
import math

import pytest

from spectrain.cli import main as cli_main
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

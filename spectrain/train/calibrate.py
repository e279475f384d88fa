"""`spectrain calibrate`: measure the verify budget `C` for a run before fitting it.

It builds the run's policy the way `SpecTrainer` does (so it lives in train/), and measures
`C` on it with `spectrain.rollout.speculation.calibration`.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from spectrain.config import SpecTrainConfig
from spectrain.models.hf_io import save_pretrained
from spectrain.rollout.speculation.calibration import CALIBRATION_FILE, CalibrationResult, measure_verify_budget
from spectrain.train.trainer import SpecTrainer


def calibration_policy_dir(config: SpecTrainConfig, work: Path) -> tuple[Path, str]:
    """The run's warm-started policy if there is one, else one built as the trainer would, saved in `work`;
    and where it came from."""
    trainer = SpecTrainer(config)
    cached = trainer.warmstart_dir / "policy"  # trainer.warmstart_dir, else <run_dir>/warmstart
    if (cached / "config.json").is_file():
        return cached, str(cached)
    trainer.tokenizer = trainer.build_tokenizer()
    save_pretrained(trainer.build_policy(), work / "policy", tokenizer=trainer.tokenizer)
    return work / "policy", "built from the recipe (random weights: only the shapes matter)"


def calibrate(config: SpecTrainConfig) -> tuple[CalibrationResult, Path]:
    """Measure `C` for the run's policy in a plain vLLM engine and write `<run_dir>/calibration.json`.

    The run directory is created (or checked) the way `spectrain fit` does, so the run can
    then be started in it with the same recipe and overrides.
    """
    SpecTrainer(config).prepare_run_dir()
    with tempfile.TemporaryDirectory(prefix="spectrain_calibrate_") as work:
        policy_dir, source = calibration_policy_dir(config, Path(work))
        result = measure_verify_budget(config, policy_dir)
    result.meta["policy"] = source
    return result, result.save(Path(config.trainer.run_dir) / CALIBRATION_FILE)

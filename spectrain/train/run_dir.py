"""The run directory: what a run writes, and what it refuses to write into.

`<run_dir>/spectrain_run.json` marks a spectrain run and records its warm-start evaluation and
result; `config.yaml` is the resolved config a resume must match; `checkpoints/last.ckpt` is
what a resume continues from; `logs/version_N/metrics.csv` holds one row per step.
"""
from __future__ import annotations

import csv
import json
import tempfile
import time
from dataclasses import is_dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from spectrain.config import SpecTrainConfig, describe_differences, to_yaml
from spectrain.errors import RunDirError

MARKER = "spectrain_run.json"


class RunDir:
    """One run's directory, for one config: checked before anything is written, then created or resumed."""

    def __init__(self, path: Path, config: SpecTrainConfig) -> None:
        self.path, self.config = Path(path), config
        self.restarted_from: str | None = None  # `check`: how the config differs from a start that left no checkpoint

    @property
    def last_checkpoint(self) -> Path:
        return self.path / "checkpoints" / "last.ckpt"

    def check(self) -> tuple[str | None, int]:
        """Refuse a run directory we may not write into, reading only; the checkpoint to resume and its step.

        A missing or empty directory starts a run. Anything else must be a spectrain run (its
        marker) that `trainer.resume` lets us continue, started with the same config, whose
        records and checkpoint can be read.
        """
        run_dir = self.path
        if run_dir.exists() and not run_dir.is_dir():
            raise RunDirError(f"{run_dir} is a file, not a directory; choose another trainer.run_dir.")
        check_writable(run_dir, "trainer.run_dir")
        if not run_dir.exists() or not any(run_dir.iterdir()):
            return None, 0
        if not (run_dir / MARKER).is_file():
            raise RunDirError(f"{run_dir} exists and is not a spectrain run directory; refusing to write into it. "
                              f"Choose another trainer.run_dir.")
        if self.config.trainer.resume == "never":
            raise RunDirError(f"{run_dir} already holds a run and trainer.resume=never; choose another "
                              f"trainer.run_dir, or set trainer.resume=auto to continue it.")
        record = self.read_record()
        last = self.last_checkpoint
        if not last.is_file():
            self.restarted_from = self._config_differences()  # a start that failed early: the new config may differ
            return None, 0
        self._check_same_config()
        if "warmstart_eval" not in record:
            raise RunDirError(f"{run_dir / MARKER} has no warm-start evaluation to resume {last} with; remove "
                              f"{last} to restart the run from its warm start, or choose another trainer.run_dir.")
        if "sampled_reward_se" not in record["warmstart_eval"]:  # another version's record: not read
            raise RunDirError(f"{run_dir / MARKER} records its warm-start evaluation without sampled_reward_se: it "
                              f"was written by another spectrain version, whose runs are not resumed; choose another "
                              f"trainer.run_dir.")
        return str(last), checkpoint_step(last)

    def create(self) -> None:
        """Start the run directory (marker, resolved config), or say that it resumes; after `check`."""
        marker = self.path / MARKER
        if marker.is_file() and self.restarted_from:
            print(f"[spectrain] {self.path} holds a start that stopped before its first checkpoint: starting it again "
                  f"with the changed config ({self.restarted_from})")
            (self.path / "config.yaml").write_text(to_yaml(self.config))
            return
        if marker.is_file():
            last = self.last_checkpoint
            print(f"[spectrain] resuming run in {self.path}" + ("" if last.is_file() else " (no checkpoint yet)"))
            return
        self.path.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))
        (self.path / "config.yaml").write_text(to_yaml(self.config))

    # a resume may train longer, report differently, run from a moved directory or trade memory for time (the
    # engine's KV cache, micro-batches, activation checkpointing: the same step to rounding), not change what it trains
    RESUME_FREE_KEYS = ("trainer.max_steps", "trainer.progress_bar", "trainer.resume", "trainer.log_every_n_steps",
                        "trainer.checkpoint_every_n_steps", "trainer.run_dir", "trainer.warmstart_dir",
                        "rollout.kv_cache_gib", "grpo.micro_batch_tokens", "policy.activation_checkpointing",
                        "trainer.logger", "trainer.project_name", "trainer.experiment_name",
                        "trainer.log_samples_every_n_steps", "trainer.log_samples_n", "trainer.keep_checkpoints",
                        "trainer.save_top_k", "trainer.save_top_k_metric", "trainer.save_top_k_mode",
                        "trainer.export_every_n_steps", "trainer.keep_exports",
                        "speculation.measure_speedup_every_n_steps", "speculation.measure_speedup_prompts")

    def _check_same_config(self) -> None:
        differences = self._config_differences()
        if differences:
            raise RunDirError(f"{self.path} was started with a different config ({differences}; see "
                              f"{self.path / 'config.yaml'}); resume it with the same recipe and overrides (only "
                              f"trainer.max_steps, reporting options, the paths and rollout.kv_cache_gib may change), "
                              f"or choose another trainer.run_dir.")

    def _config_differences(self) -> str | None:
        """How this config differs from the one the run was started with, past the resume-free keys (None: same)."""
        saved = self.path / "config.yaml"
        if not saved.is_file():
            return None
        try:
            before = OmegaConf.to_container(OmegaConf.load(saved))
        except Exception as exc:  # YAML errors: the message says where
            raise RunDirError(f"{saved} cannot be read as a spectrain config ({type(exc).__name__}: {exc}); "
                              f"restore it, or choose another trainer.run_dir.") from exc
        if not isinstance(before, dict):
            raise RunDirError(f"{saved} cannot be read as a spectrain config (it is not a mapping of keys); "
                              f"restore it, or choose another trainer.run_dir.")
        now = OmegaConf.to_container(OmegaConf.structured(self.config))
        assert isinstance(now, dict)
        theirs, ours = _layout(before, self.config), _layout(now, self.config)
        if theirs - ours:  # another spectrain's keys: its runs are not read, not translated
            self._refuse_layout(saved, theirs, ours)
        try:  # the types: a value the schema cannot hold
            OmegaConf.merge(OmegaConf.structured(SpecTrainConfig), before)
        except Exception as exc:  # omegaconf's message names the key
            raise RunDirError(f"{saved} cannot be read as a spectrain config ({type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0]}); restore it, or choose another "
                              f"trainer.run_dir.") from exc
        if ours - theirs:
            self._refuse_layout(saved, theirs, ours)
        for config in (before, now):
            for section, _, key in (k.partition(".") for k in self.RESUME_FREE_KEYS):
                config[section].pop(key, None)
        return describe_differences(before, now) if before != now else None

    @staticmethod
    def _refuse_layout(saved: Path, theirs: set[str], ours: set[str]) -> None:
        def some(keys: set[str]) -> str:
            return ", ".join(sorted(keys)[:4]) + (", ..." if len(keys) > 4 else "") if keys else "none"

        raise RunDirError(f"{saved} has another config layout than this spectrain's (keys only there: "
                          f"{some(theirs - ours)}; only here: {some(ours - theirs)}): it was started by another "
                          f"version; choose another trainer.run_dir.")

    def read_record(self) -> dict:
        """The run's marker file: what it recorded so far (creation time, warm-start evaluation, result)."""
        marker = self.path / MARKER
        try:
            record = json.loads(marker.read_text())
        except (OSError, ValueError) as exc:
            raise RunDirError(f"{marker} cannot be read ({type(exc).__name__}: {exc}); restore it, or choose "
                              f"another trainer.run_dir.") from exc
        if not isinstance(record, dict):
            raise RunDirError(f"{marker} is not a spectrain run record (a JSON object); restore it, or choose "
                              f"another trainer.run_dir.")
        return record

    def record(self, entries: dict) -> None:
        data = self.read_record()
        data.update(entries)
        (self.path / MARKER).write_text(json.dumps(data, indent=2))

    def recorded_warm_eval(self) -> dict[str, float]:
        return self.read_record()["warmstart_eval"]


def check_writable(path: Path, key: str) -> None:
    """`path` exists as a writable directory, or can be created: its nearest existing ancestor is one.

    Checked before any work, so a bad directory fails in one line instead of after the warm start.
    A directory is probed by creating a file in it (permission bits say nothing to root or on a
    read-only mount).
    """
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise RunDirError(f"{key}: cannot create {path}: {ancestor} is a file, not a directory; choose another {key}.")
    try:
        tempfile.TemporaryFile(dir=ancestor).close()
    except OSError as exc:
        raise RunDirError(f"{key}: cannot write into {ancestor} ({exc.strerror or exc}); choose a {key} in a "
                          f"writable place, or fix the permissions of {ancestor}.") from exc


def drop_logged_steps(log_dir: Path, last_kept_step: int) -> None:
    """Remove the CSV rows of steps after `last_kept_step` (the checkpoint's) from earlier log segments: a resume
    re-runs them.

    A run killed between checkpoints logged the steps after its last checkpoint; the resumed
    segment logs them again (with the same values: sampling is seeded per step), so each step
    keeps exactly one row.
    """
    for path in sorted(log_dir.glob("version_*/metrics.csv")):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            fields, rows = reader.fieldnames, list(reader)
        # the held-out row of the checkpoint's own step goes too: the resumed run evaluates that step again
        kept = [r for r in rows if not r.get("step") or int(r["step"]) < last_kept_step
                or (int(r["step"]) == last_kept_step and not any(v for k, v in r.items() if k.startswith("eval/")))]
        if fields and len(kept) < len(rows):
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(kept)


def checkpoint_step(ckpt_path: Path) -> int:
    """The checkpoint's step; it is read whole, so a corrupt file is refused before anything is written."""
    try:
        return int(torch.load(ckpt_path, map_location="cpu", weights_only=False)["global_step"])
    except Exception as exc:  # truncated zip, garbage bytes, a pickle that is no checkpoint...
        raise RunDirError(f"{ckpt_path} is corrupt or unreadable ({type(exc).__name__}: {exc}). Remove it to "
                          f"restart the run from its warm start (the warm-start cache is kept), or restore a copy "
                          f"of it.") from exc


def _layout(tree, schema, prefix: str = "") -> set[str]:
    """The dotted keys of a recorded config tree, down to the schema's sections (`schema`: a section's dataclass
    instance); a free-form mapping such as rollout.vllm_kwargs counts as one key."""
    if not isinstance(tree, dict):
        return {prefix.rstrip(".") or "(not a mapping)"}
    keys = set()
    for name, value in tree.items():
        inner = getattr(schema, str(name), None)
        keys |= _layout(value, inner, f"{prefix}{name}.") if is_dataclass(inner) else {f"{prefix}{name}"}
    return keys

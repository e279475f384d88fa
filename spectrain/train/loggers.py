"""`trainer.logger`: the Lightning loggers of a run (csv, tensorboard, wandb, mlflow), checked before anything is
written and built into the run directory."""
from __future__ import annotations

import importlib.util
import json
import os
import uuid
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from spectrain.config.schema import SpecTrainConfig
from spectrain.config.validation import logger_names
from spectrain.errors import ConfigError
from spectrain.train.run_dir import check_writable

# the module each logger imports, and what to install for it
_PACKAGES = {"tensorboard": (("tensorboard", "tensorboardX"), "pip install tensorboard (in spectrain's dev extra)"),
             "wandb": (("wandb",), "pip install 'spectrain[loggers]' (or pip install wandb)"),
             "mlflow": (("mlflow",), "pip install 'spectrain[loggers]' (or pip install mlflow-skinny)")}
IDS_FILE = "logger_ids.json"  # the wandb / MLflow run ids of the run directory: a resumed segment continues them


def check_loggers(config: SpecTrainConfig) -> list[str]:
    """The configured logger names; a logger whose package is missing is refused, naming what to install."""
    names = logger_names(config.trainer.logger)
    for name in names:
        modules, install = _PACKAGES.get(name, ((), ""))
        if modules and not any(importlib.util.find_spec(m) for m in modules):
            others = [n for n in names if n != name] or ["csv"]
            raise ConfigError(f"trainer.logger: {name} needs the {modules[0]} package; {install}, or set "
                              f"trainer.logger=[{','.join(others)}]")
    if "mlflow" in names:
        check_mlflow_store()
    return names


def check_mlflow_store() -> None:
    """A local MLflow store that MLFLOW_TRACKING_URI names (a path, a file: or sqlite: URI) must be creatable and
    writable, or the run would fail at its first log, after the warm start; a server is MLflow's to reach. Unset,
    the store is `<run_dir>/mlruns`, checked with the run directory."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        store = Path(url2pathname(urlparse(uri).path) if scheme else uri)
    elif scheme == "sqlite":  # sqlite:///relative.db, sqlite:////absolute.db: its folder holds the journal too
        store = Path(uri.removeprefix("sqlite:///")).parent
    else:
        return
    check_writable(store.expanduser(), "MLFLOW_TRACKING_URI")


def count_steps_from_one(trainer) -> None:
    """Every logger of `trainer` records a step's metrics at `trainer.global_step`, counted from 1 as
    `trainer.max_steps`, `StepResult.step`, the plots and the held-out rows count (Lightning's own calls pass its
    0-based batch count), and without Lightning's `epoch` column (always 0: the prompt stream is one endless epoch).
    """
    for logger in trainer.loggers:
        lightning_log_metrics = logger.log_metrics

        def log_metrics(metrics, step=None, _log=lightning_log_metrics):
            _log({k: v for k, v in metrics.items() if k != "epoch"}, trainer.global_step)

        logger.log_metrics = log_metrics


def build_loggers(config: SpecTrainConfig, run_dir: Path, rank_zero: bool = True) -> list:
    """One Lightning logger per `trainer.logger` name, in that order, all writing into `run_dir` by default:
    `logs/` (csv, tensorboard), `wandb/` (wandb's offline or synced run files), `mlruns/` (an MLflow file store
    unless MLFLOW_TRACKING_URI names a server). wandb and MLflow runs are named `trainer.project_name` /
    `trainer.experiment_name` (default: the run directory's name); a resumed run directory continues the same
    wandb / MLflow run (`logger_ids.json`)."""
    from lightning.pytorch.loggers import CSVLogger, Logger

    t = config.trainer
    run_name = t.experiment_name or Path(run_dir).resolve().name
    ids_path = Path(run_dir) / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    loggers: list[Logger] = []
    for name in check_loggers(config):
        if name == "csv":
            # one version_N folder per (resumed) segment: Lightning rewrites a CSV whose columns change. Rows are
            # written every step, so a killed run keeps them (a resume drops those of the steps it re-runs).
            loggers.append(CSVLogger(save_dir=str(run_dir), name="logs", flush_logs_every_n_steps=1))
        elif name == "tensorboard":
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="logs"))
        elif name == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            ids.setdefault("wandb", uuid.uuid4().hex[:12])
            loggers.append(WandbLogger(save_dir=str(run_dir), project=t.project_name, name=run_name,
                                       id=ids["wandb"], resume="allow"))
        elif name == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir).resolve() / "mlruns").as_uri()
            if uri.startswith("file:"):  # MLflow >= 3.7 refuses a file store unless this opts in
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            logger = MLFlowLogger(experiment_name=t.project_name, run_name=run_name, tracking_uri=uri,
                                  run_id=ids.get("mlflow"))
            if rank_zero:
                ids["mlflow"] = logger.run_id  # creates the run
            loggers.append(logger)
    if rank_zero and ids and Path(run_dir).is_dir():
        ids_path.write_text(json.dumps(ids, indent=2))
    return loggers

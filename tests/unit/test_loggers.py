"""`trainer.logger` (csv, tensorboard, wandb, mlflow, lists of them) and the `SampleGenerations` table: built by
`SpecTrainer.build_logger`, written through the callback, and read back from what wandb (offline) and MLflow
(a file store) wrote."""
import glob
import importlib.util
import json
import struct
import time
from types import SimpleNamespace

import pytest
import torch

from spectrain.batch import build_rollout_batch
from spectrain.callbacks import SampleGenerations
from spectrain.callbacks.sample_logger import COLUMNS
from spectrain.config import load_config
from spectrain.errors import ConfigError
from spectrain.rollout.engine import Completion, LoadStats, SpecDecodeCounters
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train.step import PolicyReport, RolloutStats, StepResult
from spectrain.train.trainer import SpecTrainer

PROMPTS, COMPLETIONS = ["12+3=", "7*8="], ["15", "56", "14", "5"]  # group size 2: completions 0, 1 of prompt 0


def step_result(step: int, tokenizer, drafts: int = 4, accepted: int = 6) -> StepResult:
    completions = [Completion(i // 2, tokenizer.encode(PROMPTS[i // 2]), tokenizer.encode(c, add_bos=False),
                              [-0.5] * len(c), True) for i, c in enumerate(COMPLETIONS)]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    batch = build_rollout_batch(completions, torch.tensor([1.0, -1.0, -1.0, 1.0]))
    spec = SpecDecodeCounters(drafts, 4 * drafts, accepted, [accepted])
    return StepResult(step, RolloutStats(1.0, 4, 10, spec, LoadStats()), rewards, batch,
                      PolicyReport(1, 0.1, 1.0, 0.0, 0.0, 0.0, 1e-5))


def fake_trainer(run_dir, loggers, global_step=0):
    return SimpleNamespace(is_global_zero=True, loggers=loggers, default_root_dir=str(run_dir), global_step=global_step)


def drive(callback, trainer, steps):
    """The hooks Lightning calls: train start, then one batch end per step (metrics logged as the module does)."""
    module = SimpleNamespace(tokenizer=CharTokenizer())
    callback.on_train_start(trainer, module)
    for s in steps:
        for logger in trainer.loggers:
            logger.log_metrics({"reward": 0.25 * s}, step=s)
        trainer.global_step = s
        callback.on_train_batch_end(trainer, module, {"step": step_result(s, module.tokenizer)}, None, 0)


def config(run_dir, *overrides):
    return load_config("tiny_cpu", [f"trainer.run_dir={run_dir}", *overrides])


def wandb_records(run_dir) -> list:
    """The records of the offline run's `.wandb` file: a LevelDB-style log (32 KiB blocks of CRC, length, type
    chunks) of `wandb_internal_pb2.Record` messages."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, chunk, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def finished_wandb_records(run_dir, timeout_s: float = 60.0) -> list:
    """The offline run's records once its `exit` record is on disk: `finish()` can return before wandb's
    service process has flushed the file, on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def test_logger_names_are_validated_with_the_fix():
    with pytest.raises(ConfigError, match=r"trainer\.logger: 'foo' is not one of \['csv', 'tensorboard', 'wandb', "
                                          r"'mlflow', 'console'\]; e\.g\. trainer\.logger=csv"):
        load_config("tiny_cpu", ["trainer.logger=foo"])
    with pytest.raises(ConfigError, match=r"trainer\.logger: 'foo' \(in \['csv', 'foo'\]\) is not one of"):
        load_config("tiny_cpu", ["trainer.logger=[csv,foo]"])
    with pytest.raises(ConfigError, match=r"trainer\.logger: 3 must be a logger name or a list of them"):
        load_config("tiny_cpu", ["trainer.logger=3"])
    with pytest.raises(ConfigError, match=r"trainer\.logger: \['csv', 'csv'\] names a logger twice"):
        load_config("tiny_cpu", ["trainer.logger=[csv,csv]"])
    with pytest.raises(ConfigError, match=r"trainer\.log_samples_n: is 0; it must be >= 1"):
        load_config("tiny_cpu", ["trainer.log_samples_n=0"])
    assert load_config("tiny_cpu", ["trainer.logger=[console,mlflow]"]).trainer.logger == ["console", "mlflow"]


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_a_missing_logger_package_names_the_extra(tmp_path, monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda m, *a: None if m in (name, "tensorboardX") else real(m, *a))
    trainer = SpecTrainer(config(tmp_path / "run", f"trainer.logger=[csv,{name}]"))
    install = "pip install tensorboard" if name == "tensorboard" else r"pip install 'spectrain\[loggers\]'"
    with pytest.raises(ConfigError, match=rf"trainer\.logger: {name} needs the {name} package; {install}.*, or set "
                                          rf"trainer\.logger=\[csv\]"):
        trainer._check_logger()
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_console_alone_is_no_logger_and_samples_still_land_in_jsonl(tmp_path):
    run = tmp_path / "run"
    assert SpecTrainer(config(run, "trainer.logger=console")).build_logger() is False
    trainer = fake_trainer(run, [])
    drive(SampleGenerations(every_n_steps=2, n=2), trainer, [1, 2, 3, 4])
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    # steps 2 and 4, 2 samples each, spread over the batch: completions 0 and 2 (one per prompt)
    assert [(r["step"], r["prompt"], r["completion"]) for r in rows] == [
        (2, "12+3=", "15"), (2, "7*8=", "14"), (4, "12+3=", "15"), (4, "7*8=", "14")]
    assert [r["reward"] for r in rows[:2]] == [1.0, 0.0] and [r["advantage"] for r in rows[:2]] == [1.0, -1.0]
    assert rows[0]["completion_tokens"] == 2 and rows[0]["step_acceptance_length"] == pytest.approx(2.5)
    assert list(rows[0]) == COLUMNS

    # a resume from step 2 re-runs steps 3 and 4: their lines go before they are logged again
    drive(SampleGenerations(every_n_steps=2, n=2), fake_trainer(run, [], global_step=2), [3, 4])
    assert [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()] == [2, 2, 4, 4]


def test_csv_and_mlflow_loggers_log_metrics_and_the_sample_table(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    run.mkdir()
    trainer = SpecTrainer(config(run, "trainer.logger=[csv,mlflow]", "trainer.project_name=proj",
                                 "trainer.experiment_name=exp1"))
    loggers = trainer.build_logger()
    assert [type(lg) for lg in loggers] == [CSVLogger, MLFlowLogger]
    drive(SampleGenerations(every_n_steps=2, n=3), fake_trainer(run, loggers), [1, 2])
    for logger in loggers:
        logger.finalize("success")

    uri = (run / "mlruns").resolve().as_uri()
    client = MlflowClient(uri)
    run_id = json.loads((run / "logger_ids.json").read_text())["mlflow"]
    got = client.get_run(run_id)
    assert got.info.run_name == "exp1" and client.get_experiment(got.info.experiment_id).name == "proj"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward")] == [(1, 0.25), (2, 0.5)]
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == ["samples/step_000002.json"]
    table = json.loads((run / "mlruns").joinpath(got.info.experiment_id, run_id, "artifacts", "samples",
                                                 "step_000002.json").read_text())
    assert table["columns"] == COLUMNS and len(table["data"]) == 3
    assert [row[1:3] for row in table["data"]] == [["12+3=", "15"], ["12+3=", "56"], ["7*8=", "14"]]
    assert (run / "logs" / "version_0" / "metrics.csv").read_text().splitlines()[1:] == ["0.25,1", "0.5,2"]

    # the resumed run directory continues the same MLflow run
    again = SpecTrainer(config(run, "trainer.logger=mlflow", "trainer.project_name=proj")).build_logger()
    assert again[0].run_id == run_id


def test_wandb_offline_logs_metrics_and_the_sample_table(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    run.mkdir()
    loggers = SpecTrainer(config(run, "trainer.logger=[wandb,tensorboard]", "trainer.project_name=proj")).build_logger()
    assert [type(lg) for lg in loggers] == [WandbLogger, TensorBoardLogger]
    try:
        drive(SampleGenerations(every_n_steps=1, n=2), fake_trainer(run, loggers), [1, 2])
        experiment = loggers[0].experiment
        assert experiment.project == "proj" and experiment.name == "run"
        assert experiment.id == json.loads((run / "logger_ids.json").read_text())["wandb"]
    finally:
        loggers[0].experiment.finish()
        loggers[1].finalize("success")

    # a history item names its key in `key`, or (wandb >= 0.2x) as the path `nested_key`
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in finished_wandb_records(run) if r.WhichOneof("record_type") == "history"]
    assert [(h["trainer/global_step"], h["reward"]) for h in history if "reward" in h] == [(1, 0.25), (2, 0.5)]
    tables = [h for h in history if h.get("samples/_type") == "table-file"]
    assert [h["trainer/global_step"] for h in tables] == [1, 2] and all(h["samples/nrows"] == 2 for h in tables)
    (files,) = glob.glob(str(run / "wandb" / "offline-run-*" / "files"))
    table = json.loads((tmp_path / files / tables[-1]["samples/path"]).read_text())
    assert table["columns"] == COLUMNS and [row[:3] for row in table["data"]] == [[2, "12+3=", "15"], [2, "7*8=", "14"]]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(str(run / "logs" / "version_0"))
    acc = EventAccumulator(events, size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1, 2]
    assert "| 2 | 12+3= | 15 |" in texts[-1].tensor_proto.string_val[0].decode()


def test_a_local_mlflow_store_must_be_writable_before_the_run(tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI as a path, a file: or a sqlite: URI names a local store, refused in one line where it
    cannot be written; a server's URI is MLflow's to reach."""
    from spectrain.errors import RunDirError
    from spectrain.train.loggers import check_loggers

    (tmp_path / "notes.txt").write_text("mine")
    mlflow = load_config("tiny_cpu", ["trainer.logger=[csv,mlflow]"])
    for uri in (f"{tmp_path}/notes.txt/mlruns", f"file://{tmp_path}/notes.txt/mlruns",
                f"sqlite:///{tmp_path}/notes.txt/mlflow.db"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        with pytest.raises(RunDirError, match=rf"^MLFLOW_TRACKING_URI: cannot create {tmp_path}/notes\.txt.*: "
                                              rf"{tmp_path}/notes\.txt is a file, not a directory"):
            check_loggers(mlflow)
        assert check_loggers(load_config("tiny_cpu", [])) == ["csv"]  # no MLflow logger: the store is not its
    for uri in (f"file://{tmp_path}/mlruns", f"sqlite:///{tmp_path}/mlflow.db", "http://127.0.0.1:5000"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert check_loggers(mlflow) == ["csv", "mlflow"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # checked without writing

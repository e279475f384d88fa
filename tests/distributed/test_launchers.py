"""`spectrain fit` on ranks that other launchers started: a multi-node torchrun rendezvous and SLURM's `srun`.

Two "nodes" on this machine, one rank each, at dp=2, each rank with its own vLLM engine: both launchers run the
same training, the srun one killed (SIGKILL on both ranks) in its second step and resumed, so every logged value
matches between them, bit for bit.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spectrain.errors import ConfigError
from spectrain.parallel.slurm import adopt_slurm_environment
from spectrain.parallel.spawn import free_port
from tests.faults import KILL_ENV
from tests.helpers import TINY, logged_steps

REPO = Path(__file__).resolve().parents[2]

FIT = ["fit", "tiny_cpu", *TINY, "parallel.dp=2", "trainer.max_steps=2", "eval.every_n_steps=0",
       "trainer.callbacks=[{target: tests.faults.SignalAtStep}]"]
ADOPTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
           "TORCHELASTIC_RUN_ID")  # torchrun's variables, as adopt_slurm_environment writes them
SLURM_JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "spectrain", "SLURM_NTASKS": "2",
             "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "2", "SLURM_NODELIST": "localhost",
             "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}  # a job step's, as `srun` sets them


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ADOPTED and not k.startswith("SLURM_") and k != KILL_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def _wait_all(processes: list[subprocess.Popen], killed: bool = False, timeout: float = 900) -> None:
    """Every process exited 0; `killed`: each was killed, or failed when its peer was (a broken connection)."""
    outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    for node, (p, out) in enumerate(zip(processes, outputs)):
        ok = p.returncode != 0 if killed else p.returncode == 0
        assert ok, f"node {node} exited {p.returncode}:\n{out[-4000:]}"
    assert not killed or -9 in [p.returncode for p in processes]


def _fit_on_two_nodes(run_dir, command_for_node, env_for_node, killed: bool = False) -> None:
    _wait_all([subprocess.Popen(command_for_node(node), env=env_for_node(node), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for node in (0, 1)], killed)
    assert (run_dir / "checkpoints/last.ckpt").is_file()


@pytest.mark.slow
def test_a_multi_node_torchrun_and_srun_run_the_same_training(tmp_path):
    port = free_port()
    torchrun_dir, srun_dir = tmp_path / "torchrun", tmp_path / "srun"
    _fit_on_two_nodes(
        torchrun_dir,
        lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                      f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
                      "-m", "spectrain.cli", *FIT, f"trainer.run_dir={torchrun_dir}"],
        lambda node: _clean_env())
    for kill in ({KILL_ENV: "1:SIGKILL"}, {}):  # killed in step 2 (after step 1's checkpoint), then resumed
        port = free_port()
        _fit_on_two_nodes(
            srun_dir,
            lambda node: [sys.executable, "-m", "spectrain.cli", *FIT, f"trainer.run_dir={srun_dir}"],
            lambda node: _clean_env(**SLURM_JOB, SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_NODEID=str(node),
                                    MASTER_PORT=str(port), **kill),  # noqa: B023 (called at once)
            killed=bool(kill))
    assert (torchrun_dir / "spectrain_run.json").is_file() and (srun_dir / "final").is_dir()
    by_torchrun, by_srun = logged_steps(torchrun_dir), logged_steps(srun_dir)
    assert sorted(by_torchrun) == [1, 2] and "reward" in by_torchrun[2] and "draft/loss" in by_torchrun[2]
    assert by_srun == by_torchrun


def test_srun_variables_become_torchruns(monkeypatch):
    for key in ADOPTED:  # set, then removed: monkeypatch restores what adopt_slurm_environment writes
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in {**SLURM_JOB, "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
                       "SLURM_NODELIST": "gpu[07-08]", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
                       "SLURM_NODEID": "1"}.items():
        monkeypatch.setenv(key, value)
    assert adopt_slurm_environment()
    assert {k: os.environ[k] for k in ADOPTED} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": "19242", "TORCHELASTIC_RUN_ID": "slurm-4242"}
    assert not adopt_slurm_environment()  # once adopted, it is a torchrun-style run


def test_uneven_srun_tasks_are_refused(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for key, value in {**SLURM_JOB, "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS_PER_NODE": "2",
                       "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="not a multiple of --ntasks-per-node=2"):
        adopt_slurm_environment()


def test_tasks_that_srun_did_not_start_are_refused_in_one_line(monkeypatch):
    """A batch script (or an salloc shell) of a job of 2 tasks runs outside any job step: its rank would wait for a
    rank nobody starts. `srun -E` keeps the allocation's task count for a smaller step: the same wait."""
    for key in ADOPTED:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    batch = {k: v for k, v in SLURM_JOB.items() if not k.startswith("SLURM_STEP_")}
    for key, value in {**batch, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"^SLURM_NTASKS=2: the job has 2 tasks, one per rank, but this process runs "
                                          r"in the batch script, outside any job step .* start the ranks with `srun "
                                          r"spectrain fit \.\.\.` in the batch script$"):
        adopt_slurm_environment()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    with pytest.raises(ConfigError, match=r"^SLURM_NTASKS=2 but srun started SLURM_STEP_NUM_TASKS=1 tasks"):
        adopt_slurm_environment()
    assert not any(key in os.environ for key in ADOPTED)  # refused before anything was adopted
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    assert adopt_slurm_environment() and os.environ["WORLD_SIZE"] == "1"  # a one-task batch job needs no srun


def test_a_rank_whose_peers_never_start_stops_after_the_timeout_with_the_fix(monkeypatch, capsys):
    from datetime import timedelta

    from spectrain.config import load_config
    from spectrain.parallel import strategy as strategy_module
    from spectrain.parallel.strategy import NotLaunchedError, SpecParallelStrategy

    monkeypatch.setattr(strategy_module, "NOTE_AFTER_S", 0.5)  # a minute, in the CLI
    port = free_port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    strategy = SpecParallelStrategy(load_config(overrides=["parallel.dp=2"]).parallel, timeout=timedelta(seconds=2))
    with pytest.raises(NotLaunchedError, match=rf"^rank 0 of 2 could not join the process group at 127\.0\.0\.1:"
                                               rf"{port} \(Timed out after \d+ seconds waiting for clients\. 1/2 "
                                               r"clients joined\.\): every rank must be started .* `srun spectrain "
                                               r"fit \.\.\.`$"):
        strategy.setup_distributed()
    assert f"[spectrain] rank 0 of 2 is waiting for the other ranks at 127.0.0.1:{port} (it gives up after 2 s)" \
        in capsys.readouterr().err


@pytest.mark.slow
def test_a_signal_stops_a_rank_that_waits_for_its_peers(tmp_path):
    """The rendezvous waits in C++, where no signal handler runs: SIGTERM must still stop it at once, in one line."""
    import psutil

    port = free_port()
    env = _clean_env(TORCHELASTIC_RUN_ID="test", RANK="0", LOCAL_RANK="0", GROUP_RANK="0", WORLD_SIZE="2",
                     LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # rank 1 never starts
    process = subprocess.Popen([sys.executable, "-m", "spectrain.cli", "fit", "tiny_cpu", "parallel.dp=2",
                                f"trainer.run_dir={tmp_path / 'run'}"], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                      for c in psutil.Process(process.pid).net_connections(kind="tcp")):  # rank 0's store: waiting
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.2)
        time.sleep(1)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 143, err
    assert err.rstrip().splitlines()[-1] == ("error: stopped by SIGTERM during the start-up checks: nothing was "
                                             "written. Run the same command again to continue."), err
    assert not (tmp_path / "run").exists()

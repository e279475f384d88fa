"""`SpecParallelStrategy`: Lightning's view of a dp x cp x pp run (registered as "spec_parallel").

One process per mesh rank, started by torchrun (`spectrain fit ... parallel.cp=N` starts it
itself). The module is not wrapped: the plan (`GRPOModule.plan`) owns every collective of
a step (sharding, ring attention, gradient reduction). Lightning gets ranks, barrier,
broadcast, reduce (for logged sums) and checkpoints from it; under dp x cp every rank holds
the whole model, so rank 0 writes a plain single-file checkpoint (under parallel.fsdp the
shards are gathered to rank 0 for it, in the same format).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from spectrain.config.schema import ParallelConfig
from spectrain.errors import ConfigError, SpecTrainError
from spectrain.parallel.lightning_compat import check_private_hooks, optimizers_to_device, sync_ddp_if_available
from spectrain.parallel.mesh import build_mesh, check_mesh_shape, world_size

STRATEGY_NAME = "spec_parallel"


class NotLaunchedError(SpecTrainError):
    """The strategy runs in a process torchrun did not start (it needs one process per mesh rank)."""


# what torchrun (and Lightning's own launchers) read to join ranks across machines; `relaunch_under_torchrun`
# starts a one-machine (`--standalone`) job that ignores them
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def check_standalone_launch(nproc: int) -> None:
    """Refuse to launch `nproc` processes on this machine alone while the environment describes another launch
    (MASTER_ADDR, NODE_RANK, ...: a multi-node run started by hand) that the relaunch would silently ignore."""
    given = [f"{name}={os.environ[name]}" for name in LAUNCH_VARIABLES if name in os.environ]
    if given:
        raise ConfigError(
            f"{', '.join(given)} set, but `spectrain fit` with {nproc} processes starts them on this machine alone "
            f"(torchrun --standalone) and would ignore them: unset them for a one-machine run, or start every "
            f"node's ranks yourself: `torchrun --nnodes=N --node-rank=R --master-addr=HOST --master-port=PORT "
            f"--nproc-per-node=P -m spectrain.cli fit ...` on each node, or `srun spectrain fit ...`")


def relaunch_under_torchrun(nproc: int, cli_args: list[str]) -> int:
    """Run `spectrain <cli_args>` as `nproc` local processes under torch.distributed.run; its exit code.

    SIGINT and SIGTERM are forwarded to the ranks themselves, which finish the step and save a
    checkpoint (`StopOnSignal`); torchrun's agent, had it got them, would kill the ranks 30 s
    later. The exit code is then 128 + the signal, as if this process had stopped on it.
    """
    import psutil

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "spectrain.cli", *cli_args]
    print(f"[spectrain] launching {nproc} processes: {' '.join(cmd)}", file=sys.stderr, flush=True)
    agent = subprocess.Popen(cmd, start_new_session=True)  # a terminal's Ctrl-C reaches only this process
    received = []

    def forward(signum, frame) -> None:
        received.append(signum)
        for rank in psutil.Process(agent.pid).children():
            rank.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = agent.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else code


NOTE_AFTER_S = 60.0  # a rank still waiting for its peers after this long says so


def join_process_group(backend: str, timeout: timedelta) -> None:
    """`init_process_group` over `env://` (RANK, WORLD_SIZE, MASTER_ADDR/PORT), waited for here, not inside torch.

    torch's rendezvous blocks in C++, where no signal handler runs: a rank whose peers were never started would
    ignore SIGTERM until `timeout`. Here it joins from a helper thread while this (main) thread waits, so a signal
    stops the wait at once (`InterruptOnSignal`); after `NOTE_AFTER_S` a note says what the rank waits for, and
    after `timeout` a rank whose peers never came stops with one line naming the launch to fix.
    """
    failure: list[BaseException] = []

    def join() -> None:
        try:
            dist.init_process_group(backend, timeout=timeout)
        except BaseException as exc:  # raised again in the main thread
            failure.append(exc)

    thread = threading.Thread(target=join, name="spectrain-rendezvous", daemon=True)
    thread.start()
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    started, noted = time.monotonic(), False
    while thread.is_alive():
        thread.join(0.2)  # short waits: signal handlers run between them
        if not noted and time.monotonic() - started > NOTE_AFTER_S:
            noted = True
            print(f"[spectrain] rank {rank} of {world} is waiting for the other ranks at {where} (it gives up after "
                  f"{timeout.total_seconds():.0f} s)", file=sys.stderr, flush=True)
    if failure:
        reason = (str(failure[0]).splitlines() or [type(failure[0]).__name__])[0]
        raise NotLaunchedError(
            f"rank {rank} of {world} could not join the process group at {where} ({reason}): every rank must be "
            f"started and reach it; `spectrain fit` starts them itself on one machine, otherwise start torchrun on "
            f"every node (the same --nnodes, --master-addr and --master-port) or `srun spectrain fit ...`"
        ) from failure[0]


class SpecParallelStrategy(ParallelStrategy):
    """Processes, mesh and plan of a multi-process run; no DDP wrapper.

    Registered as "spec_parallel" with the default `ParallelConfig` (a single process: pp = dp =
    cp = 1); a run's mesh sizes come from its recipe, so `SpecTrainer` builds the strategy
    itself from `config.parallel` and hands the instance to the Trainer.

    Args:
        parallel: mesh sizes (and the pipeline settings the pp plan reads).
        process_group_backend: default gloo on CPU, ``cpu:gloo,cuda:nccl`` on GPU (object
            broadcasts of the rollout stay on CPU).
    """

    def __init__(self, parallel: ParallelConfig | None = None, process_group_backend: str | None = None,
                 timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> None:
        check_private_hooks(ParallelStrategy, "_configure_launcher")
        if kwargs.get("cluster_environment") is None and TorchElasticEnvironment.detect():
            kwargs["cluster_environment"] = TorchElasticEnvironment()  # ranks are known before the Trainer exists
        super().__init__(**kwargs)
        self.parallel = parallel or ParallelConfig()
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._mesh: DeviceMesh | None = None
        self._plan = None
        self.num_nodes = 1  # set by the accelerator connector
        # torchrun's, read now: vLLM's CPU platform overwrites LOCAL_WORLD_SIZE with its own TP size
        self.processes_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    # processes, mesh, plan -----------------------------------------------------------------
    def _device_type(self) -> str:
        return self.root_device.type if self.parallel_devices else "cpu"

    def setup_distributed(self) -> None:
        """Join the torchrun process group, build the mesh and the plan; idempotent, callable before the Trainer.

        Every rank creates the same process groups in the same order here (`new_group` is collective).
        """
        p = self.parallel
        if not dist.is_initialized():
            check_mesh_shape(p.pp, p.dp, p.cp, world_size())  # before init: its error beats a rendezvous failure
            backend = self._process_group_backend or ("cpu:gloo,cuda:nccl" if self._device_type() == "cuda"
                                                      else "gloo")
            join_process_group(backend, self._timeout)
        if self._mesh is None:
            self._mesh = build_mesh(p.pp, p.dp, p.cp, self._device_type())
            self._plan = self.build_plan()

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("the mesh exists after setup_distributed() (the Trainer calls it in setup_environment)")
        return self._mesh

    @property
    def plan(self):
        if self._plan is None:
            raise RuntimeError("the plan exists after setup_distributed() (the Trainer calls it in setup_environment)")
        return self._plan

    def build_plan(self):
        """The `TrainPlan` for this mesh: `PipelinePlan` for pp > 1, else `ContextParallelPlan` (dp x cp).

        The parallelisms are applied one after another, as torchtitan's `parallelize` does: the plan
        splits the policy into pipeline stages (pp; pp=1 is one stage, the whole policy), `shard_model`
        shards each of this rank's stages over its dp x cp copies (parallel.fsdp), and the step runs each
        stage on this dp rank's documents, zigzag-sharded with ring attention over the cp group (cp).
        """
        if self.parallel.pp > 1:
            from spectrain.parallel.pp.plan import PipelinePlan

            return PipelinePlan(self.mesh, self.parallel.pp_schedule, self.parallel.microbatches)
        from spectrain.parallel.cp.plan import ContextParallelPlan

        return ContextParallelPlan(self.mesh)

    @override
    def connect(self, model) -> None:
        """Lightning's hook (attach the module), and hand it the plan once the mesh exists.

        `SpecTrainer` calls it after `setup_distributed`, before the Trainer exists (the warm-start
        eval already runs under the plan); a plain Lightning run gets the plan in `setup`.
        """
        super().connect(model)
        if self._plan is not None and getattr(model, "plan", None) is not self._plan:
            self._attach_plan(model)

    def _attach_plan(self, module) -> None:
        """Checks and replica sync (`plan.prepare`, collective), then `module.plan`."""
        self.plan.prepare(module)
        module.plan = self.plan

    # Lightning ---------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "parallel_devices are set by the Trainer (devices=...)"
        return self.parallel_devices[self.local_rank]

    def set_world_ranks(self) -> None:
        # not a Strategy method: Lightning's accelerator connector calls it where a strategy has it (as DDP's).
        # torchrun fixed the ranks; Lightning's rank-zero-only loggers and prints must agree
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning's

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            raise NotLaunchedError(
                f"{type(self).__name__} needs one process per mesh rank, started by torchrun: run "
                f"`spectrain fit RECIPE parallel.cp=N` (it launches them) or "
                f"`torchrun --nproc-per-node N -m spectrain.cli fit RECIPE parallel.cp=N`")

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    @override
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._attach_plan(self.lightning_module)  # again: a restored checkpoint is rank 0's on every replica
        self.shard_model()  # after that sync, before the optimizers see the parameters
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # parallel.fsdp: sharded policy and draft ---------------------------------------------
    def shard_model(self) -> None:
        """Under parallel.fsdp: shard this rank's stage(s) of the policy and the draft where it lives (bf16 compute
        under Lightning's bf16 precision)."""
        if self.parallel.fsdp:
            from spectrain.parallel.fsdp import shard_modules

            module: Any = self.lightning_module
            bf16 = str(getattr(self.precision_plugin, "precision", "32-true")).startswith("bf16")
            shard_modules(self.plan, module.policy, module.draft.model if module.draft is not None else None,
                          getattr(module, "reference", None), torch.bfloat16 if bf16 else None)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict on rank 0 (gathered shard by shard under parallel.fsdp; only rank 0 writes it)."""
        if not self.parallel.fsdp:
            return super().lightning_module_state_dict()
        from spectrain.parallel.fsdp import gathered_state_dict

        assert self.lightning_module is not None
        return gathered_state_dict(self.lightning_module, keep=self.is_global_zero)

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Under parallel.fsdp the unsharded format, gathered on rank 0: a checkpoint resumes with or without fsdp."""
        if not self.parallel.fsdp:
            return super().optimizer_state(optimizer)
        from spectrain.parallel.fsdp import gathered_optimizer_state

        return gathered_optimizer_state(getattr(optimizer, "_optimizer", optimizer), keep=self.is_global_zero)

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Every rank reads the full state; under parallel.fsdp each keeps its parameters' shards of it."""
        super().load_optimizer_state_dict(checkpoint)
        if self.parallel.fsdp:
            from spectrain.parallel.fsdp import shard_optimizer_state

            for optimizer in self.optimizers:
                shard_optimizer_state(optimizer)

    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj, src: int = 0):
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @override
    def reduce(self, tensor, group: Any | None = None, reduce_op: Any | None = "mean"):
        """In place, like DDP's (clone what you still need)."""
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, torch.Tensor) \
            else tensor

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(STRATEGY_NAME, cls,
                                   description="spectrain dp x cp x pp plans over one named mesh, no DDP wrapper")


SpecParallelStrategy.register_strategies(StrategyRegistry)

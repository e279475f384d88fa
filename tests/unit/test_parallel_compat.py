"""The torch and Lightning seams of spectrain.parallel: a missing internal fails with the versions and the fix,
and the strategy registers the way Lightning's own do."""
import re

import lightning as L
import pytest
import torch
import torch.distributed.pipelining.schedules as schedules

from spectrain.errors import SpecTrainError
from spectrain.parallel import lightning_compat, torch_compat
from spectrain.parallel.pp.runner import schedule_class, schedule_forward_order


def _error(library: str, found: str, what: str, verified: str, seam: str) -> str:
    """The message of a missing internal: what is installed, what is missing, the verified release, where to port."""
    return (rf"{library} {re.escape(found)} has no {re.escape(what)}, .*verified on {library} {re.escape(verified)}\)"
            rf".*spectrain/parallel/{seam}")


def _torch_error(what: str) -> str:
    return _error("torch", torch.__version__, what, "2.13.0", "torch_compat.py")


def test_schedules_come_from_the_config_table():
    assert schedule_class("1F1B") is schedules.Schedule1F1B
    assert issubclass(schedule_class("Interleaved1F1B"), schedules.PipelineScheduleMulti)
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'ZeroBubble'.*'GPipe'"):
        schedule_class("ZeroBubble")


def test_missing_torch_internals_name_the_verified_version(monkeypatch):
    monkeypatch.delattr(torch._utils, "_flatten_dense_tensors")
    with pytest.raises(torch_compat.TorchVersionError, match=_torch_error("torch._utils._flatten_dense_tensors")):
        torch_compat.flatten_dense_tensors([torch.zeros(2)])
    monkeypatch.delattr(schedules, "_ComputationType")
    with pytest.raises(torch_compat.TorchVersionError, match=_torch_error(
            "torch.distributed.pipelining.schedules._ComputationType")):
        torch_compat.forward_actions(object(), 0)
    with pytest.raises(torch_compat.TorchVersionError, match=_torch_error("Multi._n_microbatches")):
        schedule_forward_order(type("Multi", (), {})(), 2)
    with pytest.raises(torch_compat.TorchVersionError, match=_torch_error("DeviceMesh._flatten")):
        torch_compat.flatten_mesh(object(), "dp_cp")
    assert issubclass(torch_compat.TorchVersionError, SpecTrainError)


def test_missing_lightning_internals_name_the_verified_version(monkeypatch):
    import lightning
    import lightning.fabric.utilities.distributed as distributed
    from lightning.pytorch.strategies import ParallelStrategy, Strategy

    def lightning_error(what: str) -> str:
        return _error("Lightning", lightning.__version__, what, "2.6.6", "lightning_compat.py")

    monkeypatch.delattr(distributed, "_sync_ddp_if_available")
    with pytest.raises(lightning_compat.LightningVersionError,
                       match=lightning_error("lightning.fabric.utilities.distributed._sync_ddp_if_available")):
        lightning_compat.sync_ddp_if_available(torch.zeros(1), None, "sum")
    monkeypatch.delattr(Strategy, "_configure_launcher")
    with pytest.raises(lightning_compat.LightningVersionError,
                       match=lightning_error("ParallelStrategy._configure_launcher")):
        lightning_compat.check_private_hooks(ParallelStrategy, "_configure_launcher")


def test_strategy_registers_like_lightnings_own():
    from lightning.pytorch.strategies import StrategyRegistry

    from spectrain.parallel.strategy import STRATEGY_NAME, SpecParallelStrategy

    assert StrategyRegistry[STRATEGY_NAME]["strategy"] is SpecParallelStrategy
    registry = type(StrategyRegistry)()  # an empty registry of Lightning's kind
    SpecParallelStrategy.register_strategies(registry)
    assert registry.available_strategies() == [STRATEGY_NAME]
    strategy = registry.get(STRATEGY_NAME)  # constructible without a config: a one-process mesh
    assert (strategy.parallel.pp, strategy.parallel.dp, strategy.parallel.cp) == (1, 1, 1)


def test_trainer_resolves_the_strategy_name(monkeypatch):
    from spectrain.parallel.strategy import STRATEGY_NAME, NotLaunchedError, SpecParallelStrategy

    trainer_kwargs = dict(strategy=STRATEGY_NAME, accelerator="cpu", devices=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    for name in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(NotLaunchedError, match="started by torchrun"):
        L.Trainer(**trainer_kwargs)
    for name, value in dict(RANK="0", GROUP_RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)  # what torchrun sets in a one-process run
    assert isinstance(L.Trainer(**trainer_kwargs).strategy, SpecParallelStrategy)

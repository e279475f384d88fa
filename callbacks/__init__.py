"""Lightning callbacks of spectrain: draft co-training, weight sync, acceptance logging, held-out evaluation,
the best checkpoints, policy drift, sample tables, periodic exports, the speedup probe, run history and stopping on
a signal with a checkpoint."""
from spectrain.callbacks.acceptance_logger import AcceptanceLengthLogger
from spectrain.callbacks.best_checkpoints import BestCheckpoints
from spectrain.callbacks.draft_cotraining import DraftCoTraining
from spectrain.callbacks.held_out_eval import HeldOutEval
from spectrain.callbacks.periodic_export import PeriodicExport
from spectrain.callbacks.policy_drift import PolicyDrift
from spectrain.callbacks.run_history import RunHistory
from spectrain.callbacks.sample_logger import SampleGenerations
from spectrain.callbacks.speedup_probe import SpeedupProbe
from spectrain.callbacks.stop_on_signal import InterruptOnSignal, RunInterrupted, StopOnSignal
from spectrain.callbacks.weight_sync import SpeculationDeadError, WeightSync

__all__ = ["AcceptanceLengthLogger", "BestCheckpoints", "DraftCoTraining", "HeldOutEval", "InterruptOnSignal",
           "PeriodicExport", "PolicyDrift", "RunHistory", "RunInterrupted", "SampleGenerations", "SpeculationDeadError",
           "SpeedupProbe", "StopOnSignal", "WeightSync"]

"""Lightning callbacks of spectrain: draft co-training, weight sync, acceptance logging."""
from spectrain.callbacks.acceptance_logger import AcceptanceLengthLogger
from spectrain.callbacks.draft_cotraining import DraftCoTraining
from spectrain.callbacks.run_history import RunHistory
from spectrain.callbacks.weight_sync import SpeculationDeadError, WeightSync

__all__ = ["AcceptanceLengthLogger", "DraftCoTraining", "RunHistory", "SpeculationDeadError", "WeightSync"]

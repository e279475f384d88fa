"""Lightning callbacks of spectrain: draft co-training, weight sync, acceptance logging."""
from spectrain.callbacks.acceptance_logger import AcceptanceLengthLogger
from spectrain.callbacks.weight_sync import SpeculationDeadError, WeightSync

__all__ = ["AcceptanceLengthLogger", "SpeculationDeadError", "WeightSync"]

"""What the history-keeping callbacks share: a list of per-step rows, checkpointed."""
from __future__ import annotations

from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class HistoryCallback(Callback):
    """A callback whose state is `history`, one dict per logged step (kept across a resume)."""

    def __init__(self) -> None:
        self.history: list[dict] = []

    @override
    def state_dict(self) -> dict:
        return {"history": self.history}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict["history"])

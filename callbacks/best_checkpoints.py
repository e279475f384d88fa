"""`BestCheckpoints`: the `k` checkpoints with the best held-out metric (Lightning's `save_top_k` with `monitor`,
NeMo-RL's `keep_top_k` with `metric_name`), under `<run_dir>/checkpoints/best/`."""
from __future__ import annotations

import re
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from spectrain.callbacks.held_out_eval import HeldOutEval

_CANDIDATE = re.compile(r"candidate_step_(\d{6,})\.ckpt")
_BEST = re.compile(r"step_(\d{6,})-.*\.ckpt")


class BestCheckpoints(Callback):
    """Keeps the `k` checkpoints whose `HeldOutEval` value of `metric` (e.g. `greedy_reward`) is best.

    The held-out evaluation of step s runs after step s's checkpoints (at the start of step s + 1, once the
    weights are synced), so the checkpoint cannot wait for its score: every evaluated step's state is written as
    `candidate_step_NNNNNN.ckpt` at the end of the step, and, once its score is known, renamed to
    `step_NNNNNN-<metric>=<value>.ckpt` if it is among the `k` best, or removed. Ties keep the newer step. A resume
    removes the files of the steps it re-runs. State: the kept (step, score) pairs and the pending candidate.
    """

    runs_after = ("HeldOutEval",)  # it keeps the steps by their held-out score

    def __init__(self, dirpath: Path, metric: str, mode: str, k: int, every_n_steps: int) -> None:
        assert mode in ("max", "min") and k >= 1 and every_n_steps >= 1, (mode, k, every_n_steps)
        self.dirpath, self.metric, self.mode, self.k, self.every_n_steps = Path(dirpath), metric, mode, k, every_n_steps
        self.kept: list[dict] = []  # {"step", "score"}, best first
        self.pending: int | None = None  # the step whose candidate awaits its score

    def path(self, step: int, score: float) -> Path:
        return self.dirpath / f"step_{step:06d}-{self.metric}={score:.4f}.ckpt"

    def candidate(self, step: int) -> Path:
        return self.dirpath / f"candidate_step_{step:06d}.ckpt"

    @override
    def state_dict(self) -> dict:
        return {"kept": self.kept, "pending": self.pending}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.kept, self.pending = list(state_dict["kept"]), state_dict["pending"]

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or not self.dirpath.is_dir():
            return
        if self.pending is not None and not self.candidate(self.pending).exists():
            # the run ranked its checkpoint's step after saving it (a finished run evaluates its last step at the
            # end): a kept one becomes the candidate again, a dropped one stays dropped (an exact resume scores the
            # step the same)
            ranked = sorted(self.dirpath.glob(f"step_{self.pending:06d}-*.ckpt"))
            if ranked:
                ranked[0].rename(self.candidate(self.pending))
            else:
                self.pending = None
        kept = {self.path(r["step"], r["score"]).name for r in self.kept}
        for file in self.dirpath.iterdir():
            stale_best = _BEST.fullmatch(file.name) and file.name not in kept
            candidate = _CANDIDATE.fullmatch(file.name)
            if stale_best or (candidate and int(candidate.group(1)) != self.pending):
                file.unlink()

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._rank_pending(trainer)  # after HeldOutEval's hook of the same name: the score is in its history

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0 or step >= trainer.max_steps:
            self._save_candidate(trainer, step)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        self._rank_pending(trainer)

    def _save_candidate(self, trainer, step: int) -> None:
        self.pending = step
        trainer.save_checkpoint(self.candidate(step))  # collective (FSDP); rank 0 writes

    def _rank_pending(self, trainer) -> None:
        if self.pending is None:
            return
        score = self._score(trainer, self.pending)
        if score is None:  # not evaluated yet (a run stopped by a signal evaluates after its resume)
            return
        step, self.pending = self.pending, None
        sign = 1.0 if self.mode == "max" else -1.0
        ranked = sorted([*self.kept, {"step": step, "score": score}],
                        key=lambda r: (sign * r["score"], r["step"]), reverse=True)
        self.kept, dropped = ranked[:self.k], ranked[self.k:]
        if not trainer.is_global_zero:
            return
        if any(r["step"] == step for r in self.kept) and self.candidate(step).exists():
            self.candidate(step).rename(self.path(step, score))
        else:
            self.candidate(step).unlink(missing_ok=True)
        for r in dropped:
            if r["step"] != step:
                self.path(r["step"], r["score"]).unlink(missing_ok=True)

    def _score(self, trainer, step: int) -> float | None:
        evals = [c for c in trainer.callbacks if isinstance(c, HeldOutEval)]
        assert evals, "BestCheckpoints ranks by HeldOutEval's metrics; it needs eval.every_n_steps >= 1"
        rows = [r for r in evals[0].history if r["step"] == step and self.metric in r]
        return float(rows[-1][self.metric]) if rows else None

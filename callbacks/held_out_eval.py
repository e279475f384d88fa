"""`HeldOutEval`: the held-out reward every N steps, so the run shows learning beyond train-batch noise."""
from __future__ import annotations

import time

from typing_extensions import override

from spectrain.callbacks.history import HistoryCallback
from spectrain.errors import RunDirError


class HeldOutEval(HistoryCallback):
    """Evaluates the policy the engine serves after every `every_n_steps` steps and at the end.

    Logs `eval/greedy_reward`, `eval/sampled_reward` and `eval/sampled_reward_se`, and keeps
    the points and their `seconds` (checkpointed) for the run's plot and speed summary. The
    prompts are fixed for the whole run (the warm-start and final evaluations use the same
    ones), so the curve moves only with the policy and the sampling noise its standard error
    states. It runs at the start of the next step, after `WeightSync` pushed the weights, so the step time excludes it.
    """

    def __init__(self, examples, every_n_steps: int, samples: int, warmstart: dict[str, float] | None = None) -> None:
        assert every_n_steps >= 1, f"every_n_steps must be >= 1, got {every_n_steps}"
        self.examples, self.every_n_steps, self.samples = examples, every_n_steps, samples
        super().__init__()
        if warmstart:
            self.history.append({"step": 0, **warmstart})

    @property
    @override
    def state_key(self) -> str:
        # a second evaluation (other prompts or cadence, e.g. passed to SpecTrainer) keeps its own history; no
        # setting a resume may change (paths, trainer.max_steps) is part of it, or the resumed run would lose it
        return self._generate_state_key(every_n_steps=self.every_n_steps, samples=self.samples,
                                        prompts=len(self.examples))

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # a history under the bare class name is another layout (Lightning would restore it as a pre-1.5 key): refused
        states = checkpoint.get("callbacks") or {}
        if self.state_key not in states and type(self).__qualname__ in states:
            raise RunDirError(f"the checkpoint keeps the held-out evaluation under '{type(self).__qualname__}', not "
                              f"under its settings' key: it was written by an earlier spectrain, whose checkpoints "
                              f"are not read; start the run again in another trainer.run_dir")

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step and step % self.every_n_steps == 0:
            self._evaluate(trainer, pl_module)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step < trainer.max_steps:  # stopped early (a signal): the resumed run evaluates
            return
        if not self.history or self.history[-1]["step"] != trainer.global_step:
            self._evaluate(trainer, pl_module)

    def _evaluate(self, trainer, pl_module) -> None:
        started = time.perf_counter()
        rewards = pl_module.evaluate(self.examples, self.samples)
        self.history.append({"step": trainer.global_step, **rewards, "seconds": time.perf_counter() - started})
        # Straight to the loggers: a value passed to `self.log` from a hook repeats in every later row.
        for logger in trainer.loggers:
            logger.log_metrics({f"eval/{k}": v for k, v in rewards.items()}, step=trainer.global_step)

    def column(self, key: str) -> tuple[list[int], list[float]]:
        rows = [r for r in self.history if key in r]
        return [r["step"] for r in rows], [r[key] for r in rows]


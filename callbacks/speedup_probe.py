"""`SpeedupProbe`: what speculation buys this run, measured on its own engine every N steps."""
from __future__ import annotations

import math
import time

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

PROBE_KEYS = ("spec/speedup_estimate", "spec/probe_tokens_per_s", "spec/probe_plain_tokens_per_s")


class SpeedupProbe(Callback):
    """Every `every_n_steps` steps (from step 1), before the step's rollout, decodes the first `prompts` of the
    step's prompts twice on the engine the rollout is about to use, as it speculates now and with speculation off
    (`GRPOModule.measure_speedup`), and logs `spec/speedup_estimate` (tokens/s with over without) with both rates
    and `time/speedup_probe` (its seconds, outside `time/step`). Steps without a probe log NaN.

    The estimate holds at the sample's concurrency (`prompts` x `rollout.n` sequences), which is below the
    rollout's: speculation usually pays more at low concurrency, so it is an upper bound for the rollout itself.
    The training stream is untouched: the step's rollout re-seeds its sampling.

    Args:
        every_n_steps: probe on steps 1, 1 + n, 1 + 2n, ...
        prompts: how many of the step's prompts the sample takes.
    """

    def __init__(self, every_n_steps: int, prompts: int = 4) -> None:
        assert every_n_steps >= 1 and prompts >= 1, (every_n_steps, prompts)
        self.every_n_steps, self.prompts = every_n_steps, prompts

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.global_step % self.every_n_steps:  # on steps 1, 1 + n, ...: the one about to run
            pl_module.log_dict({key: math.nan for key in (*PROBE_KEYS, "time/speedup_probe")}, on_step=True,
                               batch_size=1)
            return
        started = time.perf_counter()
        measured = pl_module.measure_speedup(batch[:self.prompts])
        pl_module.log_dict({**measured, "time/speedup_probe": time.perf_counter() - started}, on_step=True,
                           batch_size=1)

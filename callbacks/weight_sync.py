"""`WeightSync`: push the policy and the draft into the live rollout engine after each step, and verify it."""
from __future__ import annotations

import math
import statistics
import time
from collections import deque

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from spectrain.errors import SpeculationDeadError, SyncMismatchError

# defaults by the dtype trainer and engine compute in: float32 engines agree to ~1e-7; bf16 ones by ~1e-2 on
# peaked policies and by 4-6e-2 on high-entropy ones (the tiny CPU policy)
_LOGPROB_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-1, torch.float16: 1e-1}
_WEIGHT_RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# with no acceptance history, a gain (length - 1) under this is a draft that does not predict the policy
MIN_USEFUL_GAIN = 0.1


def parameter_versions(module: torch.nn.Module) -> tuple[int, ...]:
    """The in-place version counters of `module`'s parameters: every optimizer step (and every load) bumps them."""
    return tuple(p._version for p in module.parameters())


class WeightSync(Callback):
    """Versioned policy + draft sync; every sync is verified, and so is speculation.

    - After every sync the engine's layers are probed (`VLLMRolloutEngine.verify_weights`):
      they must compute what the trainer's tensors compute, within `weight_rtol`.
    - The next rollout's logprobs must equal the trainer's before its first update: the mean
      absolute difference (the step result's `engine_logprob_diff`) must stay within `logprob_tolerance`.
    - A drafter lost in the engine (e.g. freed by sleep mode) yields acceptance length 1.00 and
      no error. When acceptance after a draft sync is poor (no token accepted; a gain `length - 1`
      under `collapse_ratio` x the median of the recent `window` steps; or, with no history yet,
      a gain under `MIN_USEFUL_GAIN`), the drafter is probed against the weights of the last
      draft sync (a copy kept on every rank with an engine: the trainer's draft has been updated since).
      A drafter that does not serve them is dead. One that does is a draft that does not (yet)
      predict this policy: a scratch or imported draft, or a policy that moved. That only warns
      (once per kind); co-training learns it, and a frozen draft is turned off under
      `on_dead="disable"`.

    A failed check raises (`on_mismatch="raise"`, `on_dead="raise"`) with the sync version, or
    with `on_mismatch="warn"` warns, counts it (`sync/mismatches`) and re-sends the weights;
    with `on_dead="disable"` the engine goes on with plain decoding and says so. One per engine,
    under the class name as its state key (a second would sync every step twice; Lightning
    refuses two stateful callbacks with one key).

    Args:
        check_alive: run the speculation check (needs a draft).
        on_mismatch: "raise" | "warn".
        on_dead: "raise" | "disable".
        logprob_tolerance, weight_rtol: None picks the default of the policy's dtype.
        collapse_ratio, window: what counts as an acceptance collapse.
        min_drafts_for_check: drafts a rollout needs before its acceptance says anything.
        frozen_draft: the draft is never trained (draft.mode=frozen): a poor one will not improve.
    """

    def __init__(self, check_alive: bool = True, on_mismatch: str = "raise", on_dead: str = "raise",
                 logprob_tolerance: float | None = None, weight_rtol: float | None = None,
                 collapse_ratio: float = 0.5, window: int = 10, min_drafts_for_check: int = 20,
                 frozen_draft: bool = False) -> None:
        assert on_mismatch in ("raise", "warn") and on_dead in ("raise", "disable"), (on_mismatch, on_dead)
        self.check_alive = check_alive
        self.on_mismatch, self.on_dead = on_mismatch, on_dead
        self.logprob_tolerance, self.weight_rtol = logprob_tolerance, weight_rtol
        self.collapse_ratio = collapse_ratio
        self.min_drafts_for_check = min_drafts_for_check
        self.frozen_draft = frozen_draft
        self.policy_version = 0
        self.draft_version = 0
        self.mismatches = 0
        self.speculation_disabled = False
        self.recent_gains: deque[float] = deque(maxlen=window)
        self._woke = False  # the engine woke from sleep mode before the rollout the next check reads
        self.warned: set[str] = set()  # the poor-draft warnings given ("cold", "worse"): each once per run
        self._draft_versions: tuple[int, ...] | None = None  # the draft parameters' in-place versions at its last sync
        self._draft_sent: list = []  # the last draft sync's tensors (CPU copies, ranks with an engine): what the probe
        # expects

    # hooks ----------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer, pl_module) -> None:
        # The engine was started from the exported weights; after a resume the module holds newer ones.
        if self.speculation_disabled:
            self._disable_engine_speculation(pl_module)
        self.push(trainer, pl_module, draft=pl_module.draft is not None)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = outputs["step"]  # the module's StepResult
        self._check_rollout_logprobs(trainer, pl_module, step.engine_logprob_diff)
        if self.check_alive and not self.speculation_disabled:
            self._check_speculation(trainer, pl_module, step.rollout.spec)
        started = time.perf_counter()
        self._woke = self._wake(pl_module) or self._woke
        self.push(trainer, pl_module, draft=pl_module.trains_draft and self._draft_changed(trainer, pl_module))
        pl_module.log_dict({"time/weight_sync": time.perf_counter() - started,
                            "sync/mismatches": float(self.mismatches)}, on_step=True, batch_size=1)

    # sync -----------------------------------------------------------------------------
    def _wake(self, pl_module) -> bool:
        """Wake every engine from sleep mode before the sync; whether any had slept (the same on every rank)."""
        engines = pl_module.engines
        slept = pl_module.engine.wake_up() if pl_module.engine is not None else False
        return any(engines.gather(slept))

    def _draft_changed(self, trainer, pl_module) -> bool:
        """Whether the draft changed since its last sync on any rank (under PP only the stage holding it trains
        it). A step without a draft update (`draft.every_n_steps`, `draft.hold_tolerance`) does not re-send it:
        reloading the drafter and probing it again would cost the step time for nothing."""
        changed = self._draft_versions != parameter_versions(pl_module.draft)
        return bool(trainer.strategy.reduce(torch.tensor(float(changed)), reduce_op="max").item() > 0)

    def push(self, trainer, pl_module, draft: bool) -> None:
        """Send the policy (and the draft) to the engine as version `global_step`, and verify both.

        Collective under FSDP and PP (the plan gathers full tensors); every rank with an engine loads its own.
        """
        version = trainer.global_step
        self._sync(trainer, pl_module, "policy", list(pl_module.policy_weights_for_sync() or ()), version)
        self.policy_version = version
        if draft:
            weights = list(pl_module.draft_weights_for_sync() or ())
            self._sync(trainer, pl_module, "draft", weights, version)
            self.draft_version = version
            self._draft_versions = parameter_versions(pl_module.draft)
            if self.check_alive and pl_module.engines.has_engine:
                self._draft_sent = [(name, t.detach().to("cpu", copy=True)) for name, t in weights]

    def _sync(self, trainer, pl_module, which: str, weights, version: int, attempt: int = 1) -> None:
        if pl_module.engines.has_engine:
            send = pl_module.engine.sync_policy if which == "policy" else pl_module.engine.sync_draft
            send(weights, version)
        problems = self._probe(trainer, pl_module, which, weights)
        if not problems:
            return
        message = (f"{which} sync version {version}: the engine does not serve the weights the trainer sent "
                   f"({len(problems)} tensors): {'; '.join(problems[:4])}" + ("; ..." if len(problems) > 4 else ""))
        self._mismatch(message + ". Check that the parameter names match the engine's checkpoint format and that "
                       "nothing else reloads the engine; sync.on_mismatch=warn re-sends instead of stopping.")
        if attempt == 1:
            self._sync(trainer, pl_module, which, weights, version, attempt=2)

    def _probe(self, trainer, pl_module, which: str, weights) -> list[str]:
        """Mismatches between every engine's `which` and `weights` ("engine e (rank r): ..." when ranks hold
        engines), the same list on every rank. Every rank with an engine probes its own part of it (a TP rank its
        shards)."""
        engines = pl_module.engines
        problems = None
        if engines.has_engine:
            rtol = self.weight_rtol or _WEIGHT_RTOL.get(_policy_dtype(pl_module), 1e-2)
            try:
                problems = pl_module.engine.verify_weights(weights, which, rtol).mismatches
            except Exception as exc:  # reported through the gather below: a raise here would hang the other ranks
                problems = [f"the weight probe failed: {exc!r}"]
        per_rank = engines.gather_every_rank(problems)
        if engines.ranks_with_engines == 1:
            return per_rank[0]
        return [f"engine {r // engines.tp_size} (rank {r}): {p}"
                for r, found in enumerate(per_rank) for p in found or ()]

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            rank_zero_warn(message)

    def _mismatch(self, message: str) -> None:
        if self.on_mismatch == "raise":
            raise SyncMismatchError(message)
        self.mismatches += 1
        rank_zero_warn(f"[spectrain] {message} (sync.on_mismatch=warn: re-sending)")

    # checks on the rollout --------------------------------------------------------------
    def _check_rollout_logprobs(self, trainer, pl_module, diff: float) -> None:
        """The rollout was sampled from the last synced policy: its logprobs (`diff`, the step's mean absolute
        difference) must be the trainer's. Under `on_mismatch="warn"` the push that follows is the re-sync."""
        tolerance = self.logprob_tolerance or _LOGPROB_TOLERANCE.get(_policy_dtype(pl_module), 1e-1)
        if math.isnan(diff) or diff <= tolerance:
            return
        self._mismatch(
            f"policy sync version {self.policy_version}: the step-{trainer.global_step} rollout's logprobs differ "
            f"from the trainer's by {diff:.2e} per token on average (sync.logprob_tolerance={tolerance:.0e}): the "
            f"engine sampled from other weights than the trainer holds. Check the policy's parameter names and "
            f"dtype against the engine's, or raise sync.logprob_tolerance if they differ on purpose")

    def _check_speculation(self, trainer, pl_module, spec) -> None:
        if spec.num_drafts < self.min_drafts_for_check:
            return
        woke, self._woke = self._woke, False
        if woke and spec.num_accepted_tokens == 0:
            self._dead(trainer, pl_module, f"after the engine woke from sleep mode (rollout.enable_sleep_mode), "
                                           f"acceptance length is exactly 1.00 over {spec.num_drafts} drafts: the "
                                           f"drafter was lost on wake (set rollout.enable_sleep_mode=false)")
            return
        gain = spec.mean_acceptance_length - 1.0
        baseline = statistics.median(self.recent_gains) if len(self.recent_gains) >= 3 else None
        self.recent_gains.append(gain)
        threshold = MIN_USEFUL_GAIN if baseline is None else self.collapse_ratio * baseline
        if spec.num_accepted_tokens > 0 and gain >= threshold:
            return
        numbers = (f"acceptance length {'is' if baseline is None else 'fell to'} {spec.mean_acceptance_length:.2f} "
                   f"over {spec.num_drafts} drafts"
                   + ("" if baseline is None else f" (recent median {1 + baseline:.2f})"))
        problems = self._probe(trainer, pl_module, "draft", self._draft_sent)
        if problems:
            self._dead(trainer, pl_module, f"after draft sync version {self.draft_version} {numbers}, and the drafter "
                                           f"is not the synced draft ({'; '.join(problems[:3])})")
        else:
            self._poor_draft(trainer, pl_module, numbers, cold=baseline is None)

    def _dead(self, trainer, pl_module, message: str) -> None:
        """The engine lost its drafter or holds other draft weights: stop, or go on without speculation."""
        message += (". Check that the engine was not put to sleep at level 2 and that the draft's parameter names "
                    "match the vLLM EAGLE-3 checkpoint")
        if self.on_dead == "raise":
            raise SpeculationDeadError(message + "; draft.on_dead=disable goes on without speculation, "
                                                 "draft.check_alive=false skips this check.")
        rank_zero_warn(f"[spectrain] {message}. draft.on_dead=disable: speculation is OFF from step "
                       f"{trainer.global_step + 1} on; rollouts continue with plain decoding.")
        self._turn_speculation_off(pl_module)

    def _poor_draft(self, trainer, pl_module, numbers: str, cold: bool) -> None:
        """The engine serves the synced draft, which predicts the policy badly: not a fault of the sync."""
        kind = "cold" if cold else "worse"
        what = (f"step {trainer.global_step}: {numbers}, and the engine serves the synced draft (version "
                f"{self.draft_version}): " + ("the draft does not predict this policy (a scratch draft, or one "
                                              "trained for another model)" if cold else
                                              "the draft predicts the policy worse than it did"))
        if self.frozen_draft and self.on_dead == "disable":
            rank_zero_warn(f"[spectrain] {what}, and draft.mode=frozen never trains it. draft.on_dead=disable: "
                           f"speculation is OFF from step {trainer.global_step + 1} on.")
            self._turn_speculation_off(pl_module)
            return
        advice = ("draft.mode=frozen never trains it, so it will not improve: the draft does not fit this policy. "
                  "draft.on_dead=disable turns speculation off when this happens; draft.mode=cotrained trains it"
                  if self.frozen_draft else "Co-training learns it from the policy's own hidden states; watch "
                                            "draft/loss and the acceptance length")
        self._warn_once(kind, f"[spectrain] {what}. {advice}. (Warned once; the run goes on with speculation.)")

    def _turn_speculation_off(self, pl_module) -> None:
        self.speculation_disabled = True
        self._disable_engine_speculation(pl_module)

    @staticmethod
    def _disable_engine_speculation(pl_module) -> None:
        if pl_module.engines.has_engine:
            pl_module.engine.disable_speculation()

    # checkpoint -----------------------------------------------------------------------
    @override
    def state_dict(self) -> dict:
        return {"policy_version": self.policy_version, "draft_version": self.draft_version,
                "mismatches": self.mismatches, "speculation_disabled": self.speculation_disabled,
                "recent_gains": list(self.recent_gains), "warned": sorted(self.warned)}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.policy_version = state_dict["policy_version"]
        self.draft_version = state_dict["draft_version"]
        self.mismatches = state_dict.get("mismatches", 0)
        self.speculation_disabled = state_dict.get("speculation_disabled", False)
        self.recent_gains.extend(state_dict.get("recent_gains", []))
        self.warned = set(state_dict.get("warned", []))


def _policy_dtype(pl_module) -> torch.dtype:
    """The coarser of the trainer's and the engine's dtype: what the two can agree to (bf16 under `policy.dtype`
    or `rollout.dtype` = bfloat16, whatever the float32 master weights)."""
    config = getattr(pl_module, "config", None)
    if config is not None and "bfloat16" in (config.policy.dtype, config.rollout.dtype):
        return torch.bfloat16
    return next(pl_module.policy.parameters()).dtype

"""`WeightSync`: the step's weight sync: push the policy and the draft into the live engines, and verify it."""
from __future__ import annotations

import math
import statistics

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from spectrain.errors import SpeculationDeadError, SyncMismatchError
from spectrain.train.online_draft import ACCEPTANCE_WINDOW, MIN_DRAFTS
from spectrain.train.step import StepModule, StepResult, SyncReport

# defaults by the dtype trainer and engine compute in: float32 engines agree to ~1e-7; bf16 ones by ~1e-2 on
# peaked policies and by 4-6e-2 on high-entropy ones (the tiny CPU policy)
_LOGPROB_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-1, torch.float16: 1e-1}
_WEIGHT_RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# with no acceptance history, a gain (length - 1) under this is a draft that does not predict the policy
MIN_USEFUL_GAIN = 0.1


class WeightSync(Callback):
    """The `weight_sync` phase of the step (a `WeightSyncer`): versioned policy + draft sync; every sync is
    verified, and so is speculation.

    - The policy's version is the GRPO step whose weights the engines serve (0: the warm start); the draft's is
      its owner's (`OnlineDraft.version`, its applied updates). A draft that did not change since its last sync
      (`draft.every_n_steps`, `draft.hold_tolerance`) is not re-sent.
    - After every sync the engine's layers are probed (`VLLMRolloutEngine.verify_weights`):
      they must compute what the trainer's tensors compute, within `weight_rtol`.
    - The rollout's logprobs must equal the trainer's before its first update: the mean absolute
      difference (`StepResult.policy.engine_logprob_diff`) must stay within `logprob_tolerance`.
    - A drafter lost in the engine (e.g. freed by sleep mode) yields acceptance length 1.00 and
      no error. When a rollout's acceptance is poor (no token accepted; a gain `length - 1` under
      `collapse_ratio` x the median of the draft's acceptance history before it; or, with fewer than three
      rollouts of history, a gain under `MIN_USEFUL_GAIN`), the drafter is probed against the weights of the last
      draft sync (the owner's copy, kept on every rank with an engine: the trainer's draft has been updated since).
      A drafter that does not serve them is dead. One that does is a draft that does not (yet)
      predict this policy: a scratch or imported draft, or a policy that moved. That only warns
      (once per kind); co-training learns it, and a frozen draft is turned off under
      `on_dead="disable"`.

    A failed check raises (`on_mismatch="raise"`, `on_dead="raise"`) with the sync version, or
    with `on_mismatch="warn"` warns, counts it (`sync/mismatches`) and re-sends the weights;
    with `on_dead="disable"` the engine goes on with plain decoding and says so. One per run
    (a second would sync every step twice).

    Args:
        check_alive: run the speculation check (needs a draft).
        on_mismatch: "raise" | "warn".
        on_dead: "raise" | "disable".
        logprob_tolerance, weight_rtol: None picks the default of the policy's dtype.
        collapse_ratio: what counts as an acceptance collapse.
        frozen_draft: the draft is never trained (draft.mode=frozen): a poor one will not improve.
    """

    def __init__(self, check_alive: bool = True, on_mismatch: str = "raise", on_dead: str = "raise",
                 logprob_tolerance: float | None = None, weight_rtol: float | None = None,
                 collapse_ratio: float = 0.5, frozen_draft: bool = False) -> None:
        assert on_mismatch in ("raise", "warn") and on_dead in ("raise", "disable"), (on_mismatch, on_dead)
        self.check_alive = check_alive
        self.on_mismatch, self.on_dead = on_mismatch, on_dead
        self.logprob_tolerance, self.weight_rtol = logprob_tolerance, weight_rtol
        self.collapse_ratio = collapse_ratio
        self.frozen_draft = frozen_draft
        self.mismatches = 0
        self.speculation_disabled = False
        self._woke = False  # the engine woke from sleep mode before the rollout the next check reads
        self.warned: set[str] = set()  # the poor-draft warnings given ("cold", "worse"): each once per run

    # the initial push and the step's phase ------------------------------------------------
    @override
    def on_train_start(self, trainer, pl_module) -> None:
        # The engine was started from the exported weights; after a resume the module holds newer ones.
        if self.speculation_disabled:
            self._disable_engine_speculation(pl_module)
        self.push(pl_module, draft=pl_module.draft is not None)

    def sync_weights(self, module: StepModule, step: StepResult, woke: bool) -> SyncReport:
        """Check the step's rollout (its logprobs, then the drafter's liveness), then push the step's weights."""
        self._check_rollout_logprobs(module, step.step, step.policy.engine_logprob_diff)
        if self.check_alive and not self.speculation_disabled and module.draft is not None:
            self._check_speculation(module, step.step, step.rollout.spec)
        self._woke = woke or self._woke
        changed = module.draft is not None and module.draft.changed_since_sent
        draft_version = self.push(module, draft=module.trains_draft and changed)
        module.log("sync/mismatches", float(self.mismatches), on_step=True, batch_size=1)
        return SyncReport(module.global_step, draft_version, self.mismatches)

    # sync -----------------------------------------------------------------------------
    def push(self, module: StepModule, draft: bool) -> int | None:
        """Send the policy (version `global_step`) and, with `draft`, the draft (its owner's version) to the
        engines, and verify both; the draft version sent, or None.

        Collective under FSDP and PP (the plan gathers full tensors); every rank with an engine loads its own.
        """
        self._sync(module, "policy", list(module.policy_weights_for_sync() or ()), module.global_step)
        if not draft:
            return None
        owner = module.draft
        assert owner is not None, "a draft sync without a draft"
        weights = list(module.draft_weights_for_sync() or ())
        self._sync(module, "draft", weights, owner.version)
        owner.mark_sent(weights, keep_copy=self.check_alive and module.engines.has_engine)
        return owner.version

    def _sync(self, module: StepModule, which: str, weights, version: int, attempt: int = 1) -> None:
        if module.engine is not None and module.engines.has_engine:
            send = module.engine.sync_policy if which == "policy" else module.engine.sync_draft
            send(weights, version)
        problems = self._probe(module, which, weights)
        if not problems:
            return
        message = (f"{which} sync version {version}: the engine does not serve the weights the trainer sent "
                   f"({len(problems)} tensors): {'; '.join(problems[:4])}" + ("; ..." if len(problems) > 4 else ""))
        self._mismatch(message + ". Check that the parameter names match the engine's checkpoint format and that "
                       "nothing else reloads the engine; sync.on_mismatch=warn re-sends instead of stopping.")
        if attempt == 1:
            self._sync(module, which, weights, version, attempt=2)

    def _probe(self, module: StepModule, which: str, weights) -> list[str]:
        """Mismatches between every engine's `which` and `weights` ("engine e (rank r): ..." when ranks hold
        engines), the same list on every rank. Every rank with an engine probes its own part of it (a TP rank its
        shards)."""
        engines = module.engines
        problems = None
        if engines.has_engine and module.engine is not None:
            rtol = self.weight_rtol or _WEIGHT_RTOL.get(_policy_dtype(module), 1e-2)
            try:
                problems = module.engine.verify_weights(weights, which, rtol).mismatches
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
    def _check_rollout_logprobs(self, module: StepModule, step: int, diff: float) -> None:
        """The rollout was sampled from the last synced policy: its logprobs (`diff`, the step's mean absolute
        difference) must be the trainer's. Under `on_mismatch="warn"` the push that follows is the re-sync."""
        tolerance = self.logprob_tolerance or _LOGPROB_TOLERANCE.get(_policy_dtype(module), 1e-1)
        if math.isnan(diff) or diff <= tolerance:
            return
        self._mismatch(
            f"policy sync version {step - 1}: the step-{step} rollout's logprobs differ "
            f"from the trainer's by {diff:.2e} per token on average (sync.logprob_tolerance={tolerance:.0e}): the "
            f"engine sampled from other weights than the trainer holds. Check the policy's parameter names and "
            f"dtype against the engine's, or raise sync.logprob_tolerance if they differ on purpose")

    def _check_speculation(self, module: StepModule, step: int, spec) -> None:
        """The step's rollout (already in the draft's acceptance history, its last entry) against the history
        before it."""
        if spec.num_drafts < MIN_DRAFTS:
            return
        woke, self._woke = self._woke, False
        if woke and spec.num_accepted_tokens == 0:
            self._dead(module, step, f"after the engine woke from sleep mode (rollout.enable_sleep_mode), "
                                     f"acceptance length is exactly 1.00 over {spec.num_drafts} drafts: the "
                                     f"drafter was lost on wake (set rollout.enable_sleep_mode=false)")
            return
        owner = module.draft
        assert owner is not None
        gain = spec.mean_acceptance_length - 1.0
        earlier = owner.acceptance[-(ACCEPTANCE_WINDOW + 1):-1]
        baseline = statistics.median(earlier) if len(earlier) >= 3 else None
        threshold = MIN_USEFUL_GAIN if baseline is None else self.collapse_ratio * baseline
        if spec.num_accepted_tokens > 0 and gain >= threshold:
            return
        numbers = (f"acceptance length {'is' if baseline is None else 'fell to'} {spec.mean_acceptance_length:.2f} "
                   f"over {spec.num_drafts} drafts"
                   + ("" if baseline is None else f" (recent median {1 + baseline:.2f})"))
        problems = self._probe(module, "draft", owner.sent)
        if problems:
            self._dead(module, step, f"after draft sync version {owner.sent_version} {numbers}, and the drafter "
                                     f"is not the synced draft ({'; '.join(problems[:3])})")
        else:
            self._poor_draft(module, step, numbers, cold=baseline is None)

    def _dead(self, module: StepModule, step: int, message: str) -> None:
        """The engine lost its drafter or holds other draft weights: stop, or go on without speculation."""
        message += (". Check that the engine was not put to sleep at level 2 and that the draft's parameter names "
                    "match the vLLM EAGLE-3 checkpoint")
        if self.on_dead == "raise":
            raise SpeculationDeadError(message + "; sync.on_dead=disable goes on without speculation, "
                                                 "sync.check_alive=false skips this check.")
        rank_zero_warn(f"[spectrain] {message}. sync.on_dead=disable: speculation is OFF from step "
                       f"{step + 1} on; rollouts continue with plain decoding.")
        self._turn_speculation_off(module)

    def _poor_draft(self, module: StepModule, step: int, numbers: str, cold: bool) -> None:
        """The engine serves the synced draft, which predicts the policy badly: not a fault of the sync."""
        kind = "cold" if cold else "worse"
        assert module.draft is not None
        what = (f"step {step}: {numbers}, and the engine serves the synced draft (version "
                f"{module.draft.sent_version}): " + ("the draft does not predict this policy (a scratch draft, or "
                                                     "one trained for another model)" if cold else
                                                     "the draft predicts the policy worse than it did"))
        if self.frozen_draft and self.on_dead == "disable":
            rank_zero_warn(f"[spectrain] {what}, and draft.mode=frozen never trains it. sync.on_dead=disable: "
                           f"speculation is OFF from step {step + 1} on.")
            self._turn_speculation_off(module)
            return
        advice = ("draft.mode=frozen never trains it, so it will not improve: the draft does not fit this policy. "
                  "sync.on_dead=disable turns speculation off when this happens; draft.mode=cotrained trains it"
                  if self.frozen_draft else "Co-training learns it from the policy's own hidden states; watch "
                                            "draft/loss and the acceptance length")
        self._warn_once(kind, f"[spectrain] {what}. {advice}. (Warned once; the run goes on with speculation.)")

    def _turn_speculation_off(self, module: StepModule) -> None:
        self.speculation_disabled = True
        self._disable_engine_speculation(module)

    @staticmethod
    def _disable_engine_speculation(module: StepModule) -> None:
        if module.engine is not None and module.engines.has_engine:
            module.engine.disable_speculation()

    # checkpoint -----------------------------------------------------------------------
    @override
    def state_dict(self) -> dict:
        return {"mismatches": self.mismatches, "speculation_disabled": self.speculation_disabled,
                "woke": self._woke, "warned": sorted(self.warned)}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.mismatches = state_dict["mismatches"]
        self.speculation_disabled = state_dict["speculation_disabled"]
        self._woke = state_dict["woke"]
        self.warned = set(state_dict["warned"])


def _policy_dtype(module: StepModule) -> torch.dtype:
    """The coarser of the trainer's and the engine's dtype: what the two can agree to (bf16 under `policy.dtype`
    or `rollout.dtype` = bfloat16, whatever the float32 master weights)."""
    config = getattr(module, "config", None)
    if config is not None and "bfloat16" in (config.policy.dtype, config.rollout.dtype):
        return torch.bfloat16
    return next(module.policy.parameters()).dtype

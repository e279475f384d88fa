"""FastGRPO's concurrency-aware rule: how many tokens to draft, from the live batch and the verify budget."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConcurrencyAwareRule:
    """Give each of `B` live sequences `C // B` verify tokens (its drafts plus the bonus token).

    The target forward costs about the same up to `C` tokens per step (memory-bound), so with
    `B` live sequences each may verify `C // B` tokens almost for free; as sequences finish,
    `B` drops and speculation deepens. For chain drafts (EAGLE-3 in vLLM) that is
    `k = clamp(C // B - 1, 0, k_max)`, so `B * (k + 1) <= C` whenever `k > 0`.

    Args:
        verify_budget: `C`, tokens per target forward where it turns compute-bound
            (`spectrain.rollout.speculation.calibration`).
        k_max: most tokens the draft may propose (the engine's `num_speculative_tokens`).
    """

    verify_budget: int
    k_max: int

    def num_speculative_tokens(self, batch_size: int) -> int:
        return min(max(self.verify_budget // batch_size - 1, 0), self.k_max)

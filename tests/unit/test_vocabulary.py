"""One word per concept (docs/glossary.md): the names the glossary retired appear in no identifier of the code.

"step" is the GRPO step only: optimizer steps are updates, vLLM's are engine steps, a ring-attention round is a
hop. Strings and comments are not scanned (an error may name an old config key to refuse it).
"""
import io
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("spectrain", "callbacks", "kernels", "benchmarks", "tests")
RETIRED = {
    "current_step": "global_step + 1, or StepResult.step",
    "PolicyStepResult": "PolicyUpdateResult (one update, not a step)",
    "micro_batch_step": "micro_batch_forward_backward",
    "_Step": "_Hop (a ring-attention round)",
    "train_step": "spot_update (the long tail's draft update)",
    "steps_trained": "OnlineDraft.updates_applied",
    "steps_skipped": "OnlineDraft.updates_skipped",
    "wants_draft_taps": "DraftUpdater.begin_draft_update",
    "train_in_tail": "GRPOModule.generate's step",
    "migrate_draft_optimizer": "nothing: old checkpoints are refused",
    "upgrade_recorded_keys": "nothing: a run directory or cache in another layout is refused",
    "kl_beta": "kl_loss_coef (verl's name)",
    "kl_estimator": "kl_loss_type (verl's name)",
    "clip_eps": "clip_ratio (verl's name)",
    "clip_eps_low": "clip_ratio_low (verl's name)",
    "clip_eps_high": "clip_ratio_high (verl's name)",
    "norm_adv_by_std": "norm_adv_by_std_in_grpo (verl's name)",
}


def identifiers(path: Path) -> set[str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


@pytest.mark.parametrize("root", SOURCES)
def test_no_retired_name_is_used(root):
    found = {f"{path.relative_to(REPO)}: {name} (use {RETIRED[name]})"
             for path in sorted((REPO / root).rglob("*.py")) if path.name != Path(__file__).name
             for name in identifiers(path) & RETIRED.keys()}
    assert not found, "\n".join(sorted(found))

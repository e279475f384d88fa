"""PolicyDrift: the drift metrics against a direct per-token computation, and the callback on a stand-in module."""
import copy
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from spectrain.callbacks import PolicyDrift
from spectrain.callbacks.policy_drift import feature_shift, kl_to_reference
from spectrain.models.hf_io import save_pretrained
from spectrain.parallel.plan import LocalPlan
from spectrain.train.online_draft import OnlineDraft
from tests.helpers import StandInModule, mixed_length_batch, step_outputs, tiny_policy

TAPS = (1, 2, 3)
POLICY = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def perturbed(model, scale: float = 0.05, seed: int = 7):
    """A copy of `model` with every weight moved a little: a policy RL has moved away from `model`."""
    moved = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return moved


def forward(model, batch):
    return model(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=TAPS)


@pytest.fixture
def outputs():
    """The policy (moved off its warm start) and the warm start, on one packed rollout, in float64."""
    reference = tiny_policy().double()
    batch = mixed_length_batch([(3, 5), (6, 2), (2, 7)], reference.cfg.vocab_size)
    with torch.no_grad():
        return forward(perturbed(reference), batch), forward(reference, batch), batch.response_mask


def test_kl_matches_a_per_token_categorical_kl(outputs):
    out, ref, mask = outputs
    per_token = [kl_divergence(Categorical(logits=out.logits[t]), Categorical(logits=ref.logits[t]))
                 for t in range(mask.numel()) if mask[t]]
    direct = sum(per_token) / len(per_token)
    assert kl_to_reference(out.logits, ref.logits, mask).item() == pytest.approx(direct.item(), rel=1e-10)
    assert direct > 1e-4  # the perturbation moved the distributions: the comparison is not 0 == 0


def test_feature_shift_matches_a_per_token_loop(outputs):
    out, ref, mask = outputs
    shifts = [math.dist(h[t].tolist(), h0[t].tolist()) / math.hypot(*h0[t].tolist())
              for h, h0 in zip(out.tap_hidden, ref.tap_hidden) for t in range(mask.numel()) if mask[t]]
    direct = sum(shifts) / len(shifts)
    assert feature_shift(out.tap_hidden, ref.tap_hidden, mask).item() == pytest.approx(direct, rel=1e-10)
    assert direct > 1e-3


def test_identical_policy_has_no_drift(outputs):
    _, ref, mask = outputs
    assert kl_to_reference(ref.logits, ref.logits.clone(), mask).item() == 0.0
    assert feature_shift(ref.tap_hidden, [h.clone() for h in ref.tap_hidden], mask).item() == 0.0


class Module(StandInModule):
    """A float64 policy and draft, with what PolicyDrift reads of a GRPOModule beside them."""

    def __init__(self, policy_path: str | None = None) -> None:
        super().__init__(POLICY, TAPS, seed=0)
        model = self.draft
        del self.draft  # the module's draft is its owner, as GRPOModule's
        self.draft = OnlineDraft(model)
        self.plan = LocalPlan()
        self.config = SimpleNamespace(policy=SimpleNamespace(path=policy_path))
        self.rollout_batch = mixed_length_batch([(3, 6), (4, 3)], POLICY["vocab_size"])
        self.logged = {}

    def log_dict(self, values, **_):
        self.logged.update(values)


def trainer_at(step: int, root: str = "unused"):
    return SimpleNamespace(global_step=step, default_root_dir=root)


def test_callback_measures_drift_from_the_warm_start_on_disk(tmp_path):
    module = Module()
    warm_start = save_pretrained(module.policy, tmp_path / "warm_start", dtype=torch.float64)
    drift = PolicyDrift(reference_dir=str(warm_start), every_n_steps=2)
    drift.on_fit_start(trainer_at(0), module)
    assert next(drift.reference.parameters()).dtype == torch.float64

    # not trained yet: the warm start itself
    drift.on_train_batch_end(trainer_at(1), module, step_outputs(module), None, 0)
    assert module.logged["drift/kl_to_warmstart"] == 0.0 and module.logged["drift/feature_shift"] == 0.0
    assert module.logged["drift/response_len"] == (6 + 3) / 2

    # skipped: NaN keeps the CSV rows aligned
    drift.on_train_batch_end(trainer_at(2), module, step_outputs(module), None, 0)
    assert all(math.isnan(module.logged[k]) for k in ("drift/kl_to_warmstart", "drift/feature_shift",
                                                       "drift/response_len"))

    module.policy = perturbed(module.policy)
    drift.on_train_batch_end(trainer_at(3), module, step_outputs(module), None, 0)
    assert module.logged["drift/kl_to_warmstart"] > 0 and module.logged["drift/feature_shift"] > 0


def test_reference_defaults_to_the_exported_warm_start_then_policy_path(tmp_path):
    module, trainer = Module(policy_path=str(tmp_path / "pretrained")), trainer_at(0, str(tmp_path))
    assert PolicyDrift().reference_path(trainer, module) == tmp_path / "pretrained"
    exported = save_pretrained(module.policy, tmp_path / "engine_init" / "policy")
    assert PolicyDrift().reference_path(trainer, module) == exported
    assert PolicyDrift(reference_dir="/given").reference_path(trainer, module) == Path("/given")


def test_refuses_without_a_warm_start_or_with_a_parallel_plan(tmp_path):
    module = Module()
    with pytest.raises(ValueError, match="pass reference_dir"):
        PolicyDrift().on_fit_start(trainer_at(0, str(tmp_path)), module)
    module.plan = SimpleNamespace()  # what SpecParallelStrategy attaches under dp/cp/pp
    with pytest.raises(ValueError, match="trainer.callbacks"):
        PolicyDrift(reference_dir=str(tmp_path)).on_fit_start(trainer_at(0, str(tmp_path)), module)

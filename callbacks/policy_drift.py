"""`PolicyDrift`: how far RL has moved the policy from its warm start, measured every step."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from spectrain.models.eagle3 import default_tap_layers
from spectrain.models.hf_io import load_pretrained
from spectrain.parallel.plan import LocalPlan

METRICS = ("drift/kl_to_warmstart", "drift/feature_shift", "drift/response_len")  # NaN on the steps it skips


def metric_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 at least (bf16 logits would round the small KLs of early RL to zero), float64 for a float64 policy."""
    return torch.promote_types(dtype, torch.float32)


def kl_to_reference(logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the `mask`ed tokens of KL(p || q) = sum_v p log(p/q) over the whole vocabulary,
    p the policy's next-token distribution and q the reference's."""
    dtype = metric_dtype(logits.dtype)
    logp = torch.log_softmax(logits[mask].to(dtype), dim=-1)
    logq = torch.log_softmax(ref_logits[mask].to(dtype), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def feature_shift(taps: list[torch.Tensor], ref_taps: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Mean over the `mask`ed tokens and the tap layers of ||h - h_0|| / ||h_0||: how far the draft's
    inputs moved from those it was warmed up on."""
    dtype = metric_dtype(taps[0].dtype)
    shifts = [(h[mask].to(dtype) - h0[mask].to(dtype)).norm(dim=-1) / h0[mask].to(dtype).norm(dim=-1)
              for h, h0 in zip(taps, ref_taps, strict=True)]
    return torch.stack(shifts).mean()


class PolicyDrift(Callback):
    """Logs, after every `every_n_steps`-th step, how far the policy has drifted from its warm start on
    the rollout it just trained on (the step result's `batch`, response tokens only):

    - `drift/kl_to_warmstart`: KL(policy || warm start) of the next-token distributions;
    - `drift/feature_shift`: relative L2 shift of the tap features (the draft's input);
    - `drift/response_len`: mean response tokens per document.

    Skipped steps log NaN, so CSV rows stay aligned. The warm start is read from disk in `on_fit_start`
    (a resumed run measures against the same one as the uninterrupted run): `reference_dir`, else the
    copy SpecTrainer exports to `<run_dir>/engine_init/policy`, else `policy.path` (a pretrained policy
    without SFT is its own warm start). It costs two forwards per measured step and a second policy in
    memory; one process only (`parallel.*` = 1).

    Args:
        reference_dir: a Hugging Face checkpoint of the warm-start policy.
        every_n_steps: measure on every n-th step.
    """

    def __init__(self, reference_dir: str | None = None, every_n_steps: int = 1) -> None:
        assert every_n_steps >= 1, f"every_n_steps must be >= 1, got {every_n_steps}"
        self.reference_dir = reference_dir
        self.every_n_steps = every_n_steps
        self.reference: torch.nn.Module | None = None

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        if not isinstance(pl_module.plan, LocalPlan):
            raise ValueError(f"trainer.callbacks: PolicyDrift measures a policy held whole by one process, but this "
                             f"run uses {type(pl_module.plan).__name__} (parallel.dp/cp/pp > 1): remove it from "
                             f"trainer.callbacks, or run with parallel.dp=parallel.cp=parallel.pp=1")
        weight = next(pl_module.policy.parameters())
        self.reference = load_pretrained(self.reference_path(trainer, pl_module), dtype=weight.dtype,
                                         device=weight.device).requires_grad_(False)

    def reference_path(self, trainer, pl_module) -> Path:
        if self.reference_dir is not None:
            return Path(self.reference_dir)
        exported = Path(trainer.default_root_dir) / "engine_init" / "policy"
        if exported.is_dir():
            return exported
        if pl_module.config.policy.path is None:
            raise ValueError(f"trainer.callbacks: PolicyDrift found no warm-start policy: {exported} does not exist "
                             f"and policy.path is null; pass reference_dir")
        return Path(pl_module.config.policy.path)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.global_step - 1) % self.every_n_steps:
            pl_module.log_dict(dict.fromkeys(METRICS, math.nan), on_step=True, batch_size=1)
            return
        pl_module.log_dict(self.measure(pl_module, outputs["step"].batch), on_step=True, batch_size=1)

    @torch.no_grad()
    def measure(self, pl_module, batch) -> dict[str, float]:
        policy = pl_module.policy
        taps = tuple(pl_module.draft.model.cfg.tap_layers) if pl_module.draft is not None \
            else default_tap_layers(policy.cfg.num_hidden_layers)
        out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=taps)
        assert self.reference is not None, "on_fit_start loads the reference"
        ref = self.reference(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=taps)
        mask = batch.response_mask
        return {"drift/kl_to_warmstart": kl_to_reference(out.logits, ref.logits, mask).item(),
                "drift/feature_shift": feature_shift(out.tap_hidden, ref.tap_hidden, mask).item(),
                "drift/response_len": batch.num_response_tokens / batch.num_docs}

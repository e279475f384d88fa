"""Pipeline parallelism for the policy: the stage split (the schedules run in `runner.py`).

A stage owns an even, contiguous slice of the decoder layers (earlier stages take the
remainder); the first stage also owns the embedding, the last the final norm and lm_head.
Stages keep HF parameter names (`model.layers.5.*`), so checkpoints and weight sync need no
renaming. Stage `s` runs on pp rank `s % pp_size` (pipelining's placement).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from spectrain.models.llama import LlamaForCausalLM, rope_cos_sin

EMBEDS_TAP = "embeds"


def layer_tap_name(layer_id: int) -> str:
    """Name of the tap carrying the residual stream entering decoder layer `layer_id`."""
    return f"layers.{layer_id}"


def stage_layer_ids(num_layers: int, num_stages: int, stage_index: int) -> range:
    """Global ids of the decoder layers stage `stage_index` owns (even split)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"cannot split {num_layers} decoder layers into {num_stages} pipeline stages: use "
            f"between 1 and {num_layers} stages (pp_size x stages per rank) or a deeper model")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} out of range for {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    start = stage_index * base + min(stage_index, extra)
    return range(start, start + base + (stage_index < extra))


def _check_tap_layers(num_layers: int, tap_layers: Sequence[int]) -> None:
    missing = sorted({int(i) for i in tap_layers if not 0 <= int(i) < num_layers})
    if missing:
        raise ValueError(
            f"aux layer ids {missing} do not exist: the policy has layers 0..{num_layers - 1}; "
            f"fix draft.tap_layers")


def tap_names_by_stage(
    num_layers: int, num_stages: int, tap_layers: Sequence[int]
) -> dict[int, tuple[str, ...]]:
    """Stage index -> taps it produces, in production order (empty when nothing is captured)."""
    _check_tap_layers(num_layers, tap_layers)
    wanted = sorted({int(i) for i in tap_layers})
    tap_names: dict[int, tuple[str, ...]] = {}
    for s in range(num_stages):
        layers = stage_layer_ids(num_layers, num_stages, s)
        names = [layer_tap_name(i) for i in wanted if i in layers]
        if s == 0 and wanted:
            names.insert(0, EMBEDS_TAP)
        tap_names[s] = tuple(names)
    return tap_names


class PolicyStage(nn.Module):
    """One pipeline stage of `LlamaForCausalLM`, sharing its parameters and HF names.

    `forward(x, position_ids, cu_seqlens, microbatch_id=None)` takes token ids `[T]` on the
    first stage, hidden states `[T, H]` elsewhere, and returns hidden states `[T, H]`, or
    `(logits [T, V], hidden [T, H])` on the last stage. Each tap (`tap_names`) is handed to
    `tap_sink(microbatch, name, tensor)` the moment it is produced, when a sink is set and
    the microbatch id is given.
    """

    def __init__(self, policy: LlamaForCausalLM, num_stages: int, stage_index: int,
                 tap_layers: Sequence[int] = ()) -> None:
        super().__init__()
        cfg = policy.cfg
        self.cfg = cfg
        self.stage_index, self.num_stages = stage_index, num_stages
        self.layer_ids = stage_layer_ids(cfg.num_hidden_layers, num_stages, stage_index)
        self.tap_layers = tuple(int(i) for i in tap_layers)
        self.tap_names = tap_names_by_stage(cfg.num_hidden_layers, num_stages, tap_layers)[stage_index]
        self._tapped_layers = {i for i in self.tap_layers if i in self.layer_ids}
        if cfg.tie_word_embeddings and num_stages > 1:
            raise ValueError(
                "tie_word_embeddings=True puts lm_head.weight on stage 0 and on the last stage; untie "
                "the embeddings (tie_word_embeddings=False) or train without pipeline parallelism")
        self.attention_ops: Any = policy.attention_ops  # the policy's, or the CP ring ops (PipelinePlan)
        self.tap_sink: Callable[[int, str, torch.Tensor], None] | None = None
        assert set(policy.model.layers.keys()) == {str(i) for i in range(cfg.num_hidden_layers)}, (
            "split_policy needs the full, unsplit policy")
        self.model: Any = nn.Module()  # `model.*` keeps the HF prefix: a container of this stage's parts
        if self.is_first:
            self.model.embed_tokens = policy.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): policy.model.layers[str(i)] for i in self.layer_ids})
        if self.is_last:
            self.model.norm = policy.model.norm
            self.lm_head: nn.Linear = policy.lm_head

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _tap(self, microbatch: int | None, name: str, x: torch.Tensor) -> None:
        if self.tap_sink is not None:
            assert microbatch is not None, f"stage {self.stage_index}: tap {name!r} needs a microbatch id"
            self.tap_sink(microbatch, name, x)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                microbatch_id: torch.Tensor | None = None):
        t = position_ids.shape[0]
        assert position_ids.dim() == 1 and x.shape[0] == t, (
            f"stage {self.stage_index}: x {tuple(x.shape)} vs position_ids {tuple(position_ids.shape)}")
        assert int(cu_seqlens[-1]) == t, "cu_seqlens[-1] must equal the token count"
        mb = None if microbatch_id is None else int(microbatch_id.reshape(-1)[0])
        if self.is_first:
            assert x.dim() == 1 and not x.is_floating_point(), (
                f"stage 0 takes token ids [T], got {x.dtype} {tuple(x.shape)}")
            x = self.model.embed_tokens(x)
            if EMBEDS_TAP in self.tap_names:
                self._tap(mb, EMBEDS_TAP, x)
        else:
            assert x.dim() == 2 and x.shape[1] == self.cfg.hidden_size, (
                f"stage {self.stage_index} takes hidden states [T, {self.cfg.hidden_size}], "
                f"got {tuple(x.shape)}")
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype,
                                self.cfg.rope_scaling)
        for idx, layer in self.model.layers.items():
            if int(idx) in self._tapped_layers:
                self._tap(mb, layer_tap_name(int(idx)), x)
            x = layer(x, cos, sin, cu_seqlens, self.attention_ops)
        if not self.is_last:
            return x
        hidden = self.model.norm(x)
        return self.lm_head(hidden), hidden


def split_policy(model: LlamaForCausalLM, num_stages: int, stage_index: int,
                 tap_layers: Sequence[int] = ()) -> PolicyStage:
    """Stage `stage_index` of `num_stages` (= pp_size x stages per rank) of `model`.

    Parameters are shared with `model`, not copied; drop `model` to free the other layers.
    `tap_layers` are the draft's tap layers: the stage taps the ones it owns (and
    the embedding output on stage 0).
    """
    return PolicyStage(model, num_stages, stage_index, tap_layers)


def local_stage_indices(pp_rank: int, pp_size: int, stages_per_rank: int = 1) -> list[int]:
    """Stage indices placed on `pp_rank` (`s % pp_size == pp_rank`, pipelining's layout)."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]

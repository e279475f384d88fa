"""Pipeline parallelism for the policy: stage split and `torch.distributed.pipelining` schedules.

A stage owns an even, contiguous slice of the decoder layers (earlier stages take the
remainder); the first stage also owns the embedding, the last the final norm and lm_head.
Stages keep HF parameter names (`model.layers.5.*`), so checkpoints and weight sync need no
renaming. Stage `s` runs on pp rank `s % pp_size` (pipelining's placement).

Packed microbatches. Pipelining allocates its activation buffers once, from fixed shapes,
and splits every `step` argument evenly along dim 0. So a microbatch is a fixed group of
whole documents padded to `tokens_per_microbatch` tokens (the padding is one extra
document, so attention never mixes it with real tokens), and the step's tensors are the
microbatches concatenated: `input_ids`/`position_ids` `[n_mb * T_mb]`, `cu_seqlens`
`[n_mb * (D + 1)]` (short microbatches repeat `T_mb`: empty documents). `position_ids`,
`cu_seqlens` and the microbatch id travel as `schedule.step` kwargs: pipelining splits them
per microbatch and hands them to every stage's forward (only the hidden states go over P2P).
A side table indexed by microbatch id would also work, but kwargs keep each stage's
forward a pure function of its inputs and need no extra state in the stage.

Gradient scale. With `scale_grads=True` pipelining divides the summed microbatch gradients
by `n_microbatches`, which only equals the single-process gradient for equal-sized mean
losses. Packed microbatches have different token counts, so the runner passes
`scale_grads=False` and `loss_fn` must return each microbatch's share of the step loss,
normalised by the *global* count (e.g. token sum / all response tokens of the step): the
step loss is then the sum over microbatches and gradients equal the single-process ones.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _ComputationType

from spectrain.models.llama import CausalLMOutput, LlamaForCausalLM, rope_cos_sin
from spectrain.parallel.pp.tap_channel import TapChannel

EMBEDS_TAP = "embeds"
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}
_MULTI_STAGE = {"Interleaved1F1B"}


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


def _check_capture_layers(num_layers: int, tap_layers: Sequence[int]) -> None:
    missing = sorted({int(i) for i in tap_layers if not 0 <= int(i) < num_layers})
    if missing:
        raise ValueError(
            f"aux layer ids {missing} do not exist: the policy has layers 0..{num_layers - 1}; "
            f"fix draft.tap_layers")


def tap_names_by_stage(
    num_layers: int, num_stages: int, tap_layers: Sequence[int]
) -> dict[int, tuple[str, ...]]:
    """Stage index -> taps it produces, in production order (empty when nothing is captured)."""
    _check_capture_layers(num_layers, tap_layers)
    wanted = sorted({int(i) for i in tap_layers})
    plan: dict[int, tuple[str, ...]] = {}
    for s in range(num_stages):
        layers = stage_layer_ids(num_layers, num_stages, s)
        names = [layer_tap_name(i) for i in wanted if i in layers]
        if s == 0 and wanted:
            names.insert(0, EMBEDS_TAP)
        plan[s] = tuple(names)
    return plan


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
        self.attention_ops = policy.attention_ops
        self.tap_sink: Callable[[int, str, torch.Tensor], None] | None = None
        assert set(policy.model.layers.keys()) == {str(i) for i in range(cfg.num_hidden_layers)}, (
            "split_policy needs the full, unsplit policy")
        self.model = nn.Module()  # `model.*` keeps the HF prefix
        if self.is_first:
            self.model.embed_tokens = policy.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): policy.model.layers[str(i)] for i in self.layer_ids})
        if self.is_last:
            self.model.norm = policy.model.norm
            self.lm_head = policy.lm_head

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
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
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
    `tap_layers` are the draft's aux layer ids: the stage taps the ones it owns (and
    the embedding output on stage 0).
    """
    return PolicyStage(model, num_stages, stage_index, tap_layers)


def local_stage_indices(pp_rank: int, pp_size: int, stages_per_rank: int = 1) -> list[int]:
    """Stage indices placed on `pp_rank` (`s % pp_size == pp_rank`, pipelining's layout)."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


class DocBatch(Protocol):
    """A packed batch the runner can cut into microbatches (e.g. `rl.batch.RolloutBatch`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor

    def select(self, doc_indices: list[int]) -> "DocBatch": ...


def plan_microbatches(
    cu_seqlens: torch.Tensor, n_microbatches: int, tokens_per_microbatch: int
) -> list[list[int]]:
    """Cut the documents into `n_microbatches` contiguous, non-empty groups that each fit.

    Greedy fill (the fewest groups any contiguous split needs), then single-document groups
    at the end if more groups are needed. Every microbatch is padded to the budget anyway,
    so balance does not change compute.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if len(lengths) < n_microbatches:
        raise ValueError(f"{len(lengths)} documents cannot fill {n_microbatches} microbatches: "
                         f"lower n_microbatches or send more documents per step")
    too_long = max(lengths)
    if too_long > tokens_per_microbatch:
        raise ValueError(f"a document of {too_long} tokens exceeds tokens_per_microbatch="
                         f"{tokens_per_microbatch}: raise tokens_per_microbatch")
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        docs_left, groups_left = len(lengths) - i, n_microbatches - len(groups)
        if groups[-1] and (used + n > tokens_per_microbatch or docs_left == groups_left):
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    if len(groups) > n_microbatches:
        raise ValueError(
            f"{sum(lengths)} tokens in {len(lengths)} documents do not fit {n_microbatches} microbatches "
            f"of {tokens_per_microbatch} tokens: raise tokens_per_microbatch or n_microbatches")
    return groups


def _pack_microbatches(mbs: Sequence[DocBatch], tokens: int, pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Concatenate microbatches padded to `tokens` each: ids, positions `[n*T]`, cu `[n*(D+1)]`."""
    docs = max(mb.cu_seqlens.numel() - 1 + (mb.input_ids.numel() < tokens) for mb in mbs)
    ids, pos, cus = [], [], []
    for mb in mbs:
        n = mb.input_ids.numel()
        assert mb.position_ids.shape == (n,) and int(mb.cu_seqlens[-1]) == n, "malformed packed microbatch"
        pad = tokens - n
        pad_ids = torch.full((pad,), pad_id, dtype=torch.long, device=device)
        ids.append(torch.cat([mb.input_ids.to(device), pad_ids]))
        pos.append(torch.cat([mb.position_ids.to(device), torch.arange(pad, device=device)]))
        cu = mb.cu_seqlens.to(device=device, dtype=torch.int32)
        empty = torch.full((docs + 1 - cu.numel(),), tokens, dtype=torch.int32, device=device)
        cus.append(torch.cat([cu, empty]))
    return torch.cat(ids), torch.cat(pos), torch.cat(cus)


def schedule_forward_order(schedule, pp_size: int) -> dict[int, list[tuple[int, int]]]:
    """Per pp rank, the `(stage, microbatch)` forward actions in execution order."""
    n_mb = schedule._n_microbatches
    if isinstance(schedule, PipelineScheduleSingle):
        # They run forwards in microbatch order; their `pipeline_order` is only a drawing
        # (torch 2.13's 1F1B one starts the last rank at microbatch 1).
        return {r: [(r, mb) for mb in range(n_mb)] for r in range(pp_size)}
    order = {
        r: [(a.stage_index, a.microbatch_index) for a in schedule.pipeline_order[r]
            if a is not None and a.computation_type == _ComputationType.FORWARD]
        for r in range(pp_size)
    }
    for r, actions in order.items():
        for s in {s for s, _ in actions}:
            assert sorted(mb for st, mb in actions if st == s) == list(range(n_mb)), (
                f"schedule order of stage {s} on rank {r} does not run microbatches 0..{n_mb - 1} once")
    return order


def make_tap_channel(stage: PolicyStage, tap_group: dist.ProcessGroup, tokens_per_microbatch: int,
                     transport: type[TapChannel] = TapChannel, ring_size: int = 2) -> TapChannel:
    """The TapChannel (or baseline transport) matching `stage`'s split and capture layers."""
    cfg, param = stage.cfg, next(stage.parameters())
    plan = tap_names_by_stage(cfg.num_hidden_layers, stage.num_stages, stage.tap_layers)
    return transport(tap_group, plan, stage.num_stages - 1, hidden_size=cfg.hidden_size,
                     capacity_tokens=tokens_per_microbatch, dtype=param.dtype, device=param.device,
                     ring_size=ring_size)


LossFn = Callable[[CausalLMOutput, Any], torch.Tensor]


class PipelineRunner:
    """One training step of the pipelined policy (and the draft loss on the last stage).

    `step(batch)` cuts `batch` (a `DocBatch`) into `n_microbatches` fixed groups of documents,
    runs the schedule, and accumulates gradients into the stages' parameters (and into
    whatever `loss_fn` touches, e.g. the draft). On the last stage `loss_fn(out, mb)` gets
    `out: CausalLMOutput` (logits and hidden of `mb`'s real tokens; `embeds` and
    `tap_hidden` in `tap_layers` order, detached, from the TapChannel) and
    `mb = batch.select(docs)`; it returns the microbatch's share of the step loss (see the
    module docstring). `step` returns the per-microbatch losses on the rank holding the last
    stage and None elsewhere.
    """

    def __init__(
        self,
        stages: PolicyStage | Sequence[PolicyStage],
        schedule_name: str,
        n_microbatches: int,
        tokens_per_microbatch: int,
        loss_fn: LossFn,
        pp_group: dist.ProcessGroup,
        tap_channel: TapChannel | None = None,
    ) -> None:
        stages = [stages] if isinstance(stages, PolicyStage) else list(stages)
        if schedule_name not in SCHEDULES:
            raise ValueError(
                f"unknown pipeline schedule {schedule_name!r}; choose one of {sorted(SCHEDULES)}")
        num_stages = stages[0].num_stages
        per_rank = len(stages)
        if schedule_name in _MULTI_STAGE and per_rank < 2:
            raise ValueError(
                f"{schedule_name} needs >= 2 stages per rank (split into pp_size x 2 stages); got 1")
        if schedule_name not in _MULTI_STAGE and per_rank != 1:
            raise ValueError(f"{schedule_name} runs one stage per rank; got {per_rank}: use Interleaved1F1B")
        if num_stages % per_rank:
            raise ValueError(f"{num_stages} stages cannot be spread over ranks holding {per_rank} each")
        pp_size = num_stages // per_rank
        if schedule_name == "1F1B" and n_microbatches < num_stages:
            raise ValueError(f"1F1B needs n_microbatches >= {num_stages} stages, got {n_microbatches}")
        if dist.get_world_size(pp_group) != pp_size:
            raise ValueError(f"{num_stages} stages with {per_rank} per rank need a pp group of "
                             f"{pp_size} ranks, got {dist.get_world_size(pp_group)}")
        pp_rank = dist.get_rank(pp_group)
        indices, expected = [s.stage_index for s in stages], local_stage_indices(pp_rank, pp_size, per_rank)
        assert indices == expected, f"pp rank {pp_rank} must hold stages {expected}, got {indices}"
        tap_layers = stages[0].tap_layers
        if bool(tap_layers) != (tap_channel is not None):
            raise ValueError(f"pass a TapChannel exactly when the stages capture aux layers "
                             f"(tap_layers={tap_layers}, tap_channel={tap_channel})")
        if tap_channel is not None:
            plan = tap_names_by_stage(stages[0].cfg.num_hidden_layers, num_stages, tap_layers)
            assert {s: n for s, n in plan.items() if n} == tap_channel.src_stages, (
                f"tap channel carries {tap_channel.src_stages}, the stages produce {plan}")
            assert tap_channel.dst_stage == num_stages - 1, "taps go to the last stage"
            assert tap_channel.capacity_tokens == tokens_per_microbatch, "tap capacity != microbatch budget"
            assert tap_channel.group is not pp_group, "the tap channel needs its own group (new_tap_group)"
            for s in stages:
                s.tap_sink = tap_channel.post
        self.stages, self.pp_group, self.pp_size = stages, pp_group, pp_size
        self.n_microbatches, self.tokens_per_microbatch = n_microbatches, tokens_per_microbatch
        self.loss_fn, self.tap_channel = loss_fn, tap_channel
        self.tap_layers = tap_layers
        self.has_first = stages[0].is_first
        self.has_last = stages[-1].is_last
        self._microbatches: list[Any] = []

        param = next(stages[0].parameters())
        self.device, dtype = param.device, param.dtype
        t, h, v = tokens_per_microbatch, stages[0].cfg.hidden_size, stages[0].cfg.vocab_size
        pipe_stages = []
        for s in stages:
            # Static shapes: no metadata-inference forward (which would also post taps).
            inp = (torch.zeros(t, dtype=torch.long, device=self.device) if s.is_first
                   else torch.zeros(t, h, dtype=dtype, device=self.device, requires_grad=True))
            out = ((torch.zeros(t, v, dtype=dtype, device=self.device, requires_grad=True),
                    torch.zeros(t, h, dtype=dtype, device=self.device, requires_grad=True)) if s.is_last
                   else torch.zeros(t, h, dtype=dtype, device=self.device, requires_grad=True))
            pipe_stages.append(PipelineStage(s, s.stage_index, num_stages, self.device,
                                             input_args=inp, output_args=out, group=pp_group))
        cls = SCHEDULES[schedule_name]
        target = pipe_stages if schedule_name in _MULTI_STAGE else pipe_stages[0]
        self.schedule = cls(target, n_microbatches, loss_fn=self._microbatch_loss, scale_grads=False)
        self._forward_order = schedule_forward_order(self.schedule, pp_size)

    def _microbatch_loss(self, output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        mb_id = int(target.reshape(-1)[0])
        mb = self._microbatches[mb_id]
        n = mb.input_ids.numel()
        logits, hidden = output
        assert logits.shape[0] == hidden.shape[0] == self.tokens_per_microbatch, (logits.shape, hidden.shape)
        embeds, aux = None, []
        if self.tap_channel is not None:
            taps = self.tap_channel.wait(mb_id)
            embeds = taps[EMBEDS_TAP][:n]
            aux = [taps[layer_tap_name(i)][:n] for i in self.tap_layers]
        loss = self.loss_fn(CausalLMOutput(logits[:n], hidden[:n], embeds, aux), mb)
        assert loss.dim() == 0, f"loss_fn must return a scalar, got {tuple(loss.shape)}"
        return loss

    def step(self, batch: DocBatch) -> list[torch.Tensor] | None:
        groups = plan_microbatches(batch.cu_seqlens, self.n_microbatches, self.tokens_per_microbatch)
        self._microbatches = [batch.select(g) for g in groups]
        ids, pos, cu = _pack_microbatches(self._microbatches, self.tokens_per_microbatch,
                                          self.stages[0].cfg.pad_token_id, self.device)
        kwargs = {"position_ids": pos, "cu_seqlens": cu, "microbatch_id": torch.arange(self.n_microbatches)}
        args = (ids,) if self.has_first else ()
        target = torch.arange(self.n_microbatches) if self.has_last else None
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        if self.tap_channel is not None:
            self.tap_channel.begin_step(self._forward_order)
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if self.tap_channel is not None:
            self.tap_channel.finish_step()
        self._microbatches = []
        return None if losses is None else [loss.detach() for loss in losses]

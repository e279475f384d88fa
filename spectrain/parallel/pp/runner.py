"""Pipeline parallelism for the policy: packed microbatches through a `torch.distributed.pipelining` schedule.

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
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from spectrain.config.schema import PP_STAGES_PER_RANK
from spectrain.models.llama import CausalLMOutput
from spectrain.parallel.fsdp import compute_dtype
from spectrain.parallel.pp.stages import (
    EMBEDS_TAP,
    PolicyStage,
    layer_tap_name,
    local_stage_indices,
    tap_names_by_stage,
)
from spectrain.parallel.pp.tap_channel import TapChannel
from spectrain.parallel.torch_compat import forward_actions, internal, schedule_microbatches


class PackedDocs(Protocol):
    """Packed documents (e.g. `spectrain.batch.RolloutBatch`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor


class DocBatch(Protocol):
    """What the runner cuts into microbatches: document lengths, and the packed documents of a group of them
    (`spectrain.batch.RolloutBatch`, or `ZigzagDocs`: this cp rank's shards)."""

    cu_seqlens: torch.Tensor

    def select(self, doc_indices: list[int]) -> PackedDocs: ...


def split_microbatches(
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


def _pack_microbatches(mbs: Sequence[PackedDocs], tokens: int, pad_id: int, device) -> tuple[torch.Tensor, ...]:
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


def schedule_class(name: str) -> type:
    """`torch.distributed.pipelining.Schedule<name>`, for a schedule of `PP_STAGES_PER_RANK` (config's table)."""
    if name not in PP_STAGES_PER_RANK:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(PP_STAGES_PER_RANK)}")
    cls = internal("torch.distributed.pipelining", "Schedule" + name)
    base = PipelineScheduleMulti if is_multi_stage(name) else PipelineScheduleSingle
    assert issubclass(cls, base), f"{cls.__name__} runs {PP_STAGES_PER_RANK[name]} stage(s) per rank: a {base.__name__}"
    return cls


def is_multi_stage(name: str) -> bool:
    return PP_STAGES_PER_RANK[name] > 1


def schedule_forward_order(schedule, pp_size: int) -> dict[int, list[tuple[int, int]]]:
    """Per pp rank, the `(stage, microbatch)` forward actions in execution order."""
    n_mb = schedule_microbatches(schedule)
    if isinstance(schedule, PipelineScheduleSingle):
        # They run forwards in microbatch order; their `pipeline_order` is only a drawing
        # (torch 2.13's 1F1B one starts the last rank at microbatch 1).
        return {r: [(r, mb) for mb in range(n_mb)] for r in range(pp_size)}
    order = {r: forward_actions(schedule, r) for r in range(pp_size)}
    for r, actions in order.items():
        for s in {s for s, _ in actions}:
            assert sorted(mb for st, mb in actions if st == s) == list(range(n_mb)), (
                f"schedule order of stage {s} on rank {r} does not run microbatches 0..{n_mb - 1} once")
    return order


def make_tap_channel(stage: PolicyStage, tap_group: dist.ProcessGroup, tokens_per_microbatch: int,
                     transport: type[TapChannel] = TapChannel, ring_size: int = 2) -> TapChannel:
    """The TapChannel (or baseline transport) matching `stage`'s split and tap layers."""
    cfg, param = stage.cfg, next(stage.parameters())
    tap_names = tap_names_by_stage(cfg.num_hidden_layers, stage.num_stages, stage.tap_layers)
    return transport(tap_group, tap_names, stage.num_stages - 1, hidden_size=cfg.hidden_size,
                     capacity_tokens=tokens_per_microbatch, dtype=compute_dtype(stage), device=param.device,
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
        cls = schedule_class(schedule_name)
        multi_stage = is_multi_stage(schedule_name)
        num_stages = stages[0].num_stages
        per_rank = len(stages)
        if multi_stage and per_rank < 2:
            raise ValueError(
                f"{schedule_name} needs >= 2 stages per rank (split into pp_size x 2 stages); got 1")
        if not multi_stage and per_rank != 1:
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
            raise ValueError(f"pass a TapChannel exactly when the stages have tap layers "
                             f"(tap_layers={tap_layers}, tap_channel={tap_channel})")
        if tap_channel is not None:
            tap_names = tap_names_by_stage(stages[0].cfg.num_hidden_layers, num_stages, tap_layers)
            assert {s: n for s, n in tap_names.items() if n} == tap_channel.src_stages, (
                f"tap channel carries {tap_channel.src_stages}, the stages produce {tap_names}")
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
        self.device, dtype = param.device, compute_dtype(stages[0])  # bf16 activations of float32 shards
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
        target = pipe_stages if multi_stage else pipe_stages[0]
        self.schedule = cls(target, n_microbatches, loss_fn=self._microbatch_loss, scale_grads=False)
        self._forward_order = schedule_forward_order(self.schedule, pp_size)

    def _microbatch_loss(self, output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        mb_id = int(target.reshape(-1)[0])
        mb = self._microbatches[mb_id]
        n = mb.input_ids.numel()
        logits, hidden = output
        assert logits.shape[0] == hidden.shape[0] == self.tokens_per_microbatch, (logits.shape, hidden.shape)
        embeds, tap_hidden = None, []
        if self.tap_channel is not None:
            taps = self.tap_channel.wait(mb_id)
            embeds = taps[EMBEDS_TAP][:n]
            tap_hidden = [taps[layer_tap_name(i)][:n] for i in self.tap_layers]
        loss = self.loss_fn(CausalLMOutput(logits[:n], hidden[:n], embeds, tap_hidden), mb)
        assert loss.dim() == 0, f"loss_fn must return a scalar, got {tuple(loss.shape)}"
        return loss

    def step(self, batch: DocBatch) -> list[torch.Tensor] | None:
        groups = split_microbatches(batch.cu_seqlens, self.n_microbatches, self.tokens_per_microbatch)
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

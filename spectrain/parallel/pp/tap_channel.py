"""TapChannel: ship the draft's taps from earlier pipeline stages to the last one.

EAGLE-3 trains on the embedding output and the residual stream entering a few aux layers,
but under pipeline parallelism those tensors are produced on earlier stages while the draft
lives on the last stage (docs/pipeline_parallel.md). Relaying them through the schedule's activations
would change the schedule; blocking sends inside the forward share ordering with the
schedule's own P2P traffic and stall (or deadlock) it. TapChannel instead:

- runs over its **own** process group over the pp ranks (`new_tap_group`), so its messages
  can never be matched against, or queued behind, the schedule's sends and receives;
- on a source stage, `post(mb, name, tap)` is called inside the stage forward as soon as the
  tap exists and fires two `isend`s (a small int64 header, then the detached payload) that
  complete in the background while the stage keeps computing;
- on the last stage, receives are posted ahead of time into landing slots, a ring of slots
  per source rank consumed in send order (FIFO per (src, dst) pair keeps microbatches
  matched); `wait(mb)` blocks only when the draft needs microbatch `mb`'s taps;
- taps are detached: nothing flows backward, the draft never trains the policy;
- what `wait` returns is owned by the channel (copied out of its landing slot, or copied
  when posted locally), never a view of a buffer that the slots or the schedule reuse.

Placement follows `torch.distributed.pipelining`: stage `s` lives on pp rank
`s % pp_size`. A tap produced on the destination rank itself (an aux layer on the last
stage, or any stage sharing its rank under interleaving) is handed over locally.

Every payload is a `[capacity_tokens, hidden]` buffer (send and receive sizes must agree on
NCCL); the header carries the valid row count, so microbatches may have different token
counts. The header also names the tap, stage and microbatch: a message that is not the one
the receiver expects next raises a RuntimeError naming both.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

_HEADER_LEN = 5  # tap code, stage, microbatch, rows, hidden


def new_tap_group(pp_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A fresh group over the pp group's ranks, in the same order, used only for taps.

    Only the members call it (local synchronization), so every pp group of a
    (pp, dp, cp) mesh can build its own tap group independently.
    """
    ranks = dist.get_process_group_ranks(pp_group)
    group = dist.new_group(ranks, use_local_synchronization=True, sort_ranks=False)
    assert dist.get_process_group_ranks(group) == ranks, "tap group must order ranks like the pp group"
    return group


@dataclass
class _Slot:
    """A landing slot: one header and one payload receive buffer."""

    header: torch.Tensor
    payload: torch.Tensor


@dataclass
class _Message:
    stage: int
    microbatch: int
    name: str


class TapChannel:
    """Asynchronous taps from source stages to `dst_stage` over a dedicated group.

    Args:
        group: the tap group (`new_tap_group(pp_group)`), never the schedule's group.
        src_stages: stage index -> names of the taps it posts, in production order.
        dst_stage: the stage that consumes the taps (the last stage).
        hidden_size, dtype: every tap is `[rows, hidden_size]` of `dtype`.
        capacity_tokens: the most rows a tap may have (the microbatch token budget).
        ring_size: landing slots per source rank, in units of one stage's taps of one
            microbatch; receives beyond them are posted as slots are consumed.

    Per step, every rank calls `begin_step(forward_order)`, source stages call `post` from
    their forward, the destination calls `wait(mb)` for each microbatch, then every rank
    calls `finish_step()`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        src_stages: Mapping[int, Sequence[str]],
        dst_stage: int,
        *,
        hidden_size: int,
        capacity_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ring_size: int = 2,
    ) -> None:
        if ring_size < 1:
            raise ValueError(f"ring_size must be >= 1, got {ring_size}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.src_stages = {int(s): tuple(names) for s, names in src_stages.items() if names}
        self.dst_stage = dst_stage
        self.dst_rank = self.stage_rank(dst_stage)
        self.hidden_size = hidden_size
        self.capacity_tokens = capacity_tokens
        self.dtype = dtype
        self.device = torch.device(device)
        self.ring_size = ring_size
        self._stage_of: dict[str, int] = {}
        for stage, names in self.src_stages.items():
            for name in names:
                if name in self._stage_of:
                    raise ValueError(f"tap {name!r} is posted by stages {self._stage_of[name]} and {stage}")
                self._stage_of[name] = stage
        self._codes = {name: i for i, name in enumerate(sorted(self._stage_of))}
        self._names = sorted(self._stage_of)
        self._slots: dict[int, list[_Slot]] = {}
        self._reset()

    # ---------------------------------------------------------------- bookkeeping
    def stage_rank(self, stage: int) -> int:
        """The tap-group rank holding `stage` (pipelining's `stage % pp_size` placement)."""
        return stage % self.group_size

    @property
    def is_destination(self) -> bool:
        return self.rank == self.dst_rank

    def _reset(self) -> None:
        self._in_step = False
        self._sends_due: deque[tuple[int, int, str]] = deque()
        self._sends: list[tuple[list[dist.Work], torch.Tensor, torch.Tensor]] = []
        self._expected: dict[int, deque[_Message]] = {}
        self._inflight: dict[int, deque[tuple[_Message, _Slot, list[dist.Work]]]] = {}
        self._free: dict[int, list[_Slot]] = {}
        self._needed: dict[int, dict[str, int]] = {}
        self._landed: dict[tuple[int, str], torch.Tensor] = {}

    def begin_step(self, forward_order: Mapping[int, Sequence[tuple[int, int]]]) -> None:
        """Arm the channel for one schedule step.

        `forward_order[r]` lists the `(stage, microbatch)` forward actions of pp rank `r`
        in execution order (`spectrain.parallel.pp.runner.schedule_forward_order`); sends from a rank follow
        it, so it fixes the FIFO order the receiver expects.
        """
        if self._in_step:
            raise RuntimeError("TapChannel.begin_step called twice without finish_step")
        self._reset()
        self._in_step = True
        for r, order in forward_order.items():
            msgs = [_Message(s, mb, name) for s, mb in order for name in self.src_stages.get(s, ())]
            if r == self.rank and r != self.dst_rank:
                self._sends_due = deque((m.stage, m.microbatch, m.name) for m in msgs)
            if not self.is_destination:
                continue
            for m in msgs:
                self._needed.setdefault(m.microbatch, {})[m.name] = r
            if r != self.dst_rank and msgs:
                self._expected[r] = deque(msgs)
                self._inflight[r] = deque()
                self._free[r] = self._landing_slots(r, len(msgs))
                self._post_receives(r)

    def finish_step(self) -> None:
        """Complete this rank's sends; on the destination, check every tap was consumed."""
        for works, _, _ in self._sends:
            for w in works:
                w.wait()
        if self.is_destination and (self._needed or self._landed):
            pending = sorted(self._needed) or sorted({mb for mb, _ in self._landed})
            raise RuntimeError(f"TapChannel: taps of microbatches {pending} were never consumed by wait()")
        if self._sends_due:
            raise RuntimeError(f"TapChannel: taps {list(self._sends_due)} were never posted")
        self._reset()

    # ---------------------------------------------------------------- source side
    def post(self, microbatch: int, name: str, tap: torch.Tensor) -> None:
        """Hand a freshly produced tap `[rows, hidden]` to the channel (detached, async)."""
        if not self._in_step:
            raise RuntimeError("TapChannel.post outside begin_step/finish_step")
        if name not in self._stage_of:
            raise RuntimeError(f"TapChannel: unknown tap {name!r}; known taps: {self._names}")
        stage = self._stage_of[name]
        assert self.stage_rank(stage) == self.rank, f"tap {name!r} belongs to stage {stage}, not this rank"
        assert tap.dim() == 2 and tap.shape[1] == self.hidden_size, (
            f"tap {name!r} must be [rows, {self.hidden_size}], got {tuple(tap.shape)}")
        assert tap.dtype == self.dtype, f"tap {name!r} has dtype {tap.dtype}, channel carries {self.dtype}"
        rows = tap.shape[0]
        if rows > self.capacity_tokens:
            raise ValueError(f"tap {name!r} has {rows} rows > capacity_tokens={self.capacity_tokens}")
        tap = tap.detach()
        if self.is_destination:
            key = (microbatch, name)
            if key in self._landed:
                raise RuntimeError(f"TapChannel: tap {name!r} of microbatch {microbatch} posted twice")
            # A copy the channel owns: a local tap can be the stage's input, i.e. the buffer pipelining
            # receives activations into and reuses on the next `schedule.step()`, while the draft trains on
            # every step's taps only after the last one (grpo.minibatches > 1).
            self._landed[key] = tap.clone()
            return
        expected = self._sends_due.popleft() if self._sends_due else None
        if expected != (stage, microbatch, name):
            raise RuntimeError(
                f"TapChannel: stage {stage} posted tap {name!r} of microbatch {microbatch}, "
                f"but the schedule order expects {expected} (stage, microbatch, tap) next")
        header = torch.tensor([self._codes[name], stage, microbatch, rows, self.hidden_size],
                              dtype=torch.int64, device=self.device)
        payload = tap.contiguous()
        if rows < self.capacity_tokens:
            payload = torch.zeros(self.capacity_tokens, self.hidden_size, dtype=self.dtype, device=tap.device)
            payload[:rows] = tap
        self._sends = [s for s in self._sends if not all(w.is_completed() for w in s[0])]
        self._sends.append((self._send(header, payload), header, payload))

    def _send(self, header: torch.Tensor, payload: torch.Tensor) -> list[dist.Work]:
        return [_posted(dist.isend(header, group=self.group, group_dst=self.dst_rank)),
                _posted(dist.isend(payload, group=self.group, group_dst=self.dst_rank))]

    # ---------------------------------------------------------------- destination side
    def _new_slot(self) -> _Slot:
        payload = torch.empty(self.capacity_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        return _Slot(torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device), payload)

    def _landing_slots(self, src_rank: int, num_messages: int) -> list[_Slot]:
        per_mb = max(len(self.src_stages[s]) for s in self.src_stages if self.stage_rank(s) == src_rank)
        count = min(num_messages, self.ring_size * per_mb)
        if len(self._slots.get(src_rank, ())) != count:  # kept across steps
            self._slots[src_rank] = [self._new_slot() for _ in range(count)]
        return list(self._slots[src_rank])

    def _post_receives(self, src_rank: int) -> None:
        expected, free = self._expected[src_rank], self._free[src_rank]
        while expected and free:
            msg, slot = expected.popleft(), free.pop()
            works = [_posted(dist.irecv(slot.header, group=self.group, group_src=src_rank)),
                     _posted(dist.irecv(slot.payload, group=self.group, group_src=src_rank))]
            self._inflight[src_rank].append((msg, slot, works))

    def _land_one(self, src_rank: int) -> None:
        """Complete the oldest receive from `src_rank`, check it, copy it out, re-arm the slot."""
        inflight = self._inflight.get(src_rank)
        if not inflight:
            raise RuntimeError(f"TapChannel: no more taps are expected from pp rank {src_rank}")
        msg, slot, (header_work, payload_work) = inflight.popleft()
        header_work.wait()
        code, stage, mb, rows, hidden = slot.header.tolist()
        got_name = self._names[code] if 0 <= code < len(self._names) else f"<code {code}>"
        if (got_name, stage, mb) != (msg.name, msg.stage, msg.microbatch):
            raise RuntimeError(
                f"TapChannel: expected tap {msg.name!r} of microbatch {msg.microbatch} from stage "
                f"{msg.stage}, got tap {got_name!r} of microbatch {mb} from stage {stage}: the pp "
                f"ranks disagree on the schedule's forward order")
        if hidden != self.hidden_size or not 0 <= rows <= self.capacity_tokens:
            raise RuntimeError(
                f"TapChannel: tap {msg.name!r} of microbatch {mb}: expected [<= {self.capacity_tokens}, "
                f"{self.hidden_size}], got [{rows}, {hidden}]")
        payload_work.wait()
        self._landed[(mb, msg.name)] = slot.payload[:rows].clone()  # the slot is reused at once
        self._free[src_rank].append(slot)
        self._post_receives(src_rank)

    def wait(self, microbatch: int) -> dict[str, torch.Tensor]:
        """All taps of `microbatch` (name -> `[rows, hidden]`, detached); blocks until landed."""
        if not self.is_destination:
            raise RuntimeError(f"TapChannel.wait on pp rank {self.rank}; taps land on rank {self.dst_rank}")
        if microbatch not in self._needed:
            raise RuntimeError(
                f"TapChannel: microbatch {microbatch} is not expected this step (or was already waited for)")
        needed = self._needed.pop(microbatch)
        for name, src_rank in needed.items():
            while (microbatch, name) not in self._landed:
                if src_rank == self.rank:
                    raise RuntimeError(
                        f"TapChannel: local tap {name!r} of microbatch {microbatch} was never posted")
                self._land_one(src_rank)
        return {name: self._landed.pop((microbatch, name)) for name in needed}


class BlockingTapTransport(TapChannel):
    """Baseline (the prior art) for the benchmark: blocking sends inside the forward.

    Same interface and same dedicated group as TapChannel, but each `post` blocks the
    source stage's forward until its tap is delivered: communication is serialized with
    the source's compute. The receiver must still post *all* the step's receives up front:
    a rendezvous send (gloo, NCCL) blocked inside stage 0's forward of microbatch m waits
    for a receive that a last stage blocked on m's activations could never post, so a
    receiver that blocks in its own forward or loss deadlocks.
    """

    def _send(self, header: torch.Tensor, payload: torch.Tensor) -> list[dist.Work]:
        dist.send(header, group=self.group, group_dst=self.dst_rank)
        dist.send(payload, group=self.group, group_dst=self.dst_rank)
        return []

    def _landing_slots(self, src_rank: int, num_messages: int) -> list[_Slot]:
        return [self._new_slot() for _ in range(num_messages)]


def _posted(work: dist.Work | None) -> dist.Work:
    """A point-to-point op's handle (torch types it optional: None only on ranks outside the group)."""
    assert work is not None, "a tap message posted from outside its group"
    return work

"""Zigzag context-parallel (CP) layout for packed documents.

Every document is padded at its end to a multiple of ``2 * cp_size`` and cut into
``2 * cp_size`` equal chunks; CP rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r``
of every document (front chunk first, then back chunk). Pairing an early, cheap chunk
with a late, expensive one gives every rank the same causal-attention work, and every
rank holds the same number of tokens with the same local ``cu_seqlens``.

Padding sits at the end of each document, so under causal attention no real token
ever sees a pad token: outputs and gradients of real tokens are exact. Pad rows get
``pad_value`` from :func:`shard` and ``valid = False`` (use it as a loss mask).

See ``docs/context_parallel.md`` for pictures and the communication volumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ZigzagLayout", "ShiftRoutes", "shard", "unshard", "gather_unshard", "shift_left"]


@dataclass(frozen=True, eq=False)
class ZigzagLayout:
    """Where each local token of one CP rank comes from. Build with :meth:`build`.

    Attributes:
        cp_size, cp_rank: the CP group size and this rank's index in it.
        cu_seqlens: ``[N+1]`` int64, global, unpadded (as given).
        cu_seqlens_padded: ``[N+1]`` int64, global, every document padded.
        cu_seqlens_local: ``[N+1]`` int32, this rank's packed shard (same on all ranks);
            document i's local part is its front chunk then its back chunk.
        position_ids: ``[T_local]`` int64, position of each local token inside its
            document (pad tokens continue counting past the document's end); for RoPE.
        global_index: ``[T_local]`` int64, row of each local token in the unpadded global
            tensor, ``-1`` on pad tokens.
        valid: ``[T_local]`` bool, False on pad tokens (the loss mask of the padding).
        doc_ids: ``[T_local]`` int64, document index of each local token.
    """

    cp_size: int
    cp_rank: int
    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    cu_seqlens_local: Tensor
    position_ids: Tensor
    global_index: Tensor
    valid: Tensor
    doc_ids: Tensor
    _shift_routes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        cu_seqlens: Tensor,
        cp_size: int,
        cp_rank: int,
        max_seqlen: int | None = None,
        device: torch.device | str | None = None,
    ) -> "ZigzagLayout":
        """Compute the layout once per batch (index math on CPU, results on ``device``).

        ``max_seqlen`` (e.g. the RoPE table length) bounds each *padded* document.
        """
        if cp_size < 1:
            raise ValueError(
                f"cp_size must be >= 1, got {cp_size}; use cp_size=1 to run without "
                "context parallelism"
            )
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
        device = cu_seqlens.device if device is None else torch.device(device)
        cu = _check_cu_seqlens(cu_seqlens)
        lens = cu.diff()
        multiple = 2 * cp_size
        padded = (lens + multiple - 1) // multiple * multiple
        if max_seqlen is not None and len(padded) and int(padded.max()) > max_seqlen:
            i = int(padded.argmax())
            raise ValueError(
                f"document {i} has {int(lens[i])} tokens, padded to {int(padded[i])} (a "
                f"multiple of 2*cp_size={multiple}), which exceeds max_seqlen={max_seqlen}; "
                f"raise max_seqlen to >= {int(padded.max())}, lower cp_size, or cut long "
                "documents before packing"
            )
        chunk = padded // multiple
        cu_padded = _cumsum0(padded)
        cu_local = _cumsum0(2 * chunk)
        doc_ids, pos = _local_positions(chunk, cu_local, cp_size, cp_rank)
        valid = pos < lens[doc_ids]
        global_index = torch.where(valid, cu[doc_ids] + pos, torch.full_like(pos, -1))
        return cls(
            cp_size=cp_size,
            cp_rank=cp_rank,
            cu_seqlens=cu.to(device),
            cu_seqlens_padded=cu_padded.to(device),
            cu_seqlens_local=cu_local.to(device=device, dtype=torch.int32),
            position_ids=pos.to(device),
            global_index=global_index.to(device),
            valid=valid.to(device),
            doc_ids=doc_ids.to(device),
        )

    @property
    def num_local_tokens(self) -> int:
        return self.position_ids.shape[0]

    @property
    def num_global_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def for_rank(self, cp_rank: int) -> "ZigzagLayout":
        """The layout of another rank of the same CP group (same batch)."""
        if cp_rank == self.cp_rank:
            return self
        return ZigzagLayout.build(
            self.cu_seqlens, self.cp_size, cp_rank, device=self.cu_seqlens.device
        )

    def shift_routes(self, shift: int) -> "ShiftRoutes":
        """The (cached) row routes of :func:`shift_left` for this shift."""
        if shift not in self._shift_routes:
            self._shift_routes[shift] = ShiftRoutes.build(self, shift)
        return self._shift_routes[shift]


def _check_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must be 1-D and start at 0, got {cu_seqlens.tolist()}")
    if bool((cu.diff() < 0).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    return cu


def _cumsum0(x: Tensor) -> Tensor:
    return torch.cat([x.new_zeros(1), x.cumsum(0)])


def _local_positions(
    chunk: Tensor, cu_local: Tensor, cp_size: int, cp_rank: int
) -> tuple[Tensor, Tensor]:
    """Document id and in-document position of every local token of ``cp_rank``."""
    total = int(cu_local[-1])
    doc_ids = torch.repeat_interleave(torch.arange(len(chunk)), 2 * chunk, output_size=total)
    j = torch.arange(total) - cu_local[doc_ids]  # offset inside the doc's local part
    c = chunk[doc_ids]
    front = cp_rank * c + j
    back = (2 * cp_size - 1 - cp_rank) * c + (j - c)
    return doc_ids, torch.where(j < c, front, back)


def _owner(pos: Tensor, doc_ids: Tensor, chunk: Tensor, cu_local: Tensor, cp_size: int):
    """(rank, local row) holding in-document position ``pos`` of document ``doc_ids``."""
    c = chunk[doc_ids]
    k = pos // c
    is_front = k < cp_size
    rank = torch.where(is_front, k, 2 * cp_size - 1 - k)
    row = cu_local[doc_ids] + pos - k * c + torch.where(is_front, 0, c)
    return rank, row


def shard(x: Tensor, layout: ZigzagLayout, pad_value: float | int | bool = 0) -> Tensor:
    """This rank's zigzag shard of a global packed tensor (dim 0 = tokens).

    Pad rows are ``pad_value``: pass the pad token id for ``input_ids``, 0 for loss masks.
    """
    if x.shape[0] != layout.num_global_tokens:
        raise ValueError(
            f"x has {x.shape[0]} rows but cu_seqlens describes {layout.num_global_tokens} tokens"
        )
    out = x.new_full((layout.num_local_tokens, *x.shape[1:]), pad_value)
    out[layout.valid] = x[layout.global_index[layout.valid]]
    return out


def unshard(shards: Sequence[Tensor], layout: ZigzagLayout) -> Tensor:
    """Rebuild the global unpadded tensor from every rank's shard (in CP rank order)."""
    if len(shards) != layout.cp_size:
        raise ValueError(f"expected {layout.cp_size} shards (one per CP rank), got {len(shards)}")
    first = shards[0]
    out = first.new_empty((layout.num_global_tokens, *first.shape[1:]))
    for rank, local in enumerate(shards):
        lay = layout.for_rank(rank)
        assert local.shape[0] == lay.num_local_tokens, (local.shape, lay.num_local_tokens)
        out[lay.global_index[lay.valid]] = local[lay.valid]
    return out


def gather_unshard(x: Tensor, layout: ZigzagLayout, group: dist.ProcessGroup) -> Tensor:
    """All-gather the shards of ``group`` and :func:`unshard` them.

    Moves the full tensor to every rank: for checks, metrics and debugging, not for the
    training step (no autograd).
    """
    shards = [torch.empty_like(x) for _ in range(layout.cp_size)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard(shards, layout)


@dataclass(frozen=True, eq=False)
class ShiftRoutes:
    """Rows moved by ``shift_left``: local copies plus one send/recv list per peer rank.

    ``recv[peer]`` are the local rows filled from ``peer``; ``send[peer]`` the local rows
    ``peer`` needs from us, in the order it expects them. Every rank derives both from the
    shared batch layout, so no sizes are exchanged.
    """

    shift: int
    fill_rows: Tensor
    local_dst: Tensor
    local_src: Tensor
    recv: dict[int, Tensor]
    send: dict[int, Tensor]

    @classmethod
    def build(cls, layout: ZigzagLayout, shift: int) -> "ShiftRoutes":
        cu = layout.cu_seqlens.cpu()
        lens = cu.diff()
        chunk = (lens + 2 * layout.cp_size - 1) // (2 * layout.cp_size)
        cu_local = layout.cu_seqlens_local.cpu().long()
        device = layout.position_ids.device

        def sources(rank: int) -> tuple[Tensor, Tensor, Tensor]:
            """For ``rank``: its rows with a target, the target's owner rank and row."""
            doc_ids, pos = _local_positions(chunk, cu_local, layout.cp_size, rank)
            target, n = pos + shift, lens[doc_ids]
            rows = torch.nonzero((pos < n) & (target >= 0) & (target < n)).flatten()
            owner, src = _owner(target[rows], doc_ids[rows], chunk, cu_local, layout.cp_size)
            return rows, owner, src

        me = layout.cp_rank
        rows, owner, src = sources(me)
        fill = torch.ones(layout.num_local_tokens, dtype=torch.bool)
        fill[rows] = False
        recv, send = {}, {}
        for peer in range(layout.cp_size):
            if peer != me:
                mine = owner == peer
                if bool(mine.any()):
                    recv[peer] = rows[mine].to(device)
                _, p_owner, p_src = sources(peer)
                theirs = p_owner == me
                if bool(theirs.any()):
                    send[peer] = p_src[theirs].to(device)
        local = owner == me
        return cls(
            shift=shift,
            fill_rows=torch.nonzero(fill).flatten().to(device),
            local_dst=rows[local].to(device),
            local_src=src[local].to(device),
            recv=recv,
            send=send,
        )


def shift_left(
    x: Tensor,
    layout: ZigzagLayout,
    shift: int,
    group: dist.ProcessGroup | None,
    fill: float | int = 0,
) -> Tensor:
    """Row ``i`` of the result is ``x`` at global position ``i + shift`` of the same document.

    Rows whose target falls outside the document (past its real end, or before its start
    for a negative shift) and pad rows get ``fill``. Only the rows that cross a chunk
    boundary travel, point to point: for ``|shift|`` <= the chunk length that is at most
    ``|shift|`` rows per chunk, i.e. ``2 * |shift|`` rows per document per rank, from the
    two zigzag neighbours. Differentiable (the backward sends the gradients back).
    ``group`` may be None only when ``cp_size == 1``.
    """
    if layout.cp_size > 1:
        if group is None or dist.get_world_size(group) != layout.cp_size:
            raise ValueError("shift_left needs the CP process group of the layout")
        assert dist.get_rank(group) == layout.cp_rank, (dist.get_rank(group), layout.cp_rank)
    assert x.shape[0] == layout.num_local_tokens, (x.shape, layout.num_local_tokens)
    return _ShiftLeft.apply(x, layout.shift_routes(shift), group, fill)


class _ShiftLeft(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, routes: ShiftRoutes, group, fill) -> Tensor:
        ctx.routes, ctx.group, ctx.n = routes, group, x.shape[0]
        out = torch.empty_like(x)
        out[routes.fill_rows] = fill
        out[routes.local_dst] = x[routes.local_src]
        received = _exchange(x, routes.send, routes.recv, group)
        for peer, dst in routes.recv.items():
            out[dst] = received[peer]
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        routes = ctx.routes
        dx = grad.new_zeros((ctx.n, *grad.shape[1:]))
        dx.index_add_(0, routes.local_src, grad[routes.local_dst])
        # The transpose: gradients of received rows go back to where the rows came from.
        returned = _exchange(grad, routes.recv, routes.send, ctx.group)
        for peer, src in routes.send.items():
            dx.index_add_(0, src, returned[peer])
        return dx, None, None, None


def _exchange(
    x: Tensor, send: dict[int, Tensor], recv: dict[int, Tensor], group
) -> dict[int, Tensor]:
    """Send ``x[send[p]]`` to each peer p and receive ``len(recv[p])`` rows from each."""
    bufs = {p: x.new_empty((len(rows), *x.shape[1:])) for p, rows in recv.items()}
    ops = [dist.P2POp(dist.isend, x[rows].contiguous(), group=group, group_peer=p)
           for p, rows in send.items()]
    ops += [dist.P2POp(dist.irecv, buf, group=group, group_peer=p) for p, buf in bufs.items()]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return bufs

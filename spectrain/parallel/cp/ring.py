"""Zigzag ring attention: causal attention over a context-parallel group.

Each CP rank holds the zigzag shard of every document (see ``spectrain.parallel.cp.zigzag``):
its front chunk ``r`` then its back chunk ``2P-1-r``, equal lengths. K/V travel the ring
``r -> r+1`` for ``P-1`` hops; at hop ``s`` rank ``r`` holds the K/V of rank ``r-s``:

* ``s = 0``: causal attention on the local shard (local order is causal order).
* ``1 <= s <= r``: the source's front chunk is earlier than both local chunks and its back
  chunk later than both: all local queries against the **front** half of the K/V, no mask.
* ``s > r``: both source chunks are later than the local front chunk and earlier than the
  local back chunk: the **back** half of the queries against all the K/V, no mask.

So every hop after the first is half the work of a full unmasked block, the same on every
rank. Partial results are merged by LSE (``merge_attn``, fp32 or fp64). The next K/V is
posted with ``batch_isend_irecv`` before the current hop is computed (comm/compute overlap).

Backward (as ring-flash-attention): K/V go round again, and dK/dV accumulators travel with
them, so after ``P`` hops each rank's accumulator comes home holding every rank's part.
``attn_backward`` with the final joint ``(out, lse)`` gives each hop's exact part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from spectrain.ops.attention import LocalAttentionOps
from spectrain.ops.lse_merge import merge_attn

__all__ = ["ZigzagRingAttentionOps", "zigzag_ring_attention"]


class _RingComm:
    """Send a tensor to group rank ``r+1`` and receive one from ``r-1``, asynchronously."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._reqs: list = []

    def send_recv(self, x: Tensor) -> Tensor:
        """Post the exchange and return the receive buffer; valid after :meth:`wait`.

        ``x`` must not be modified until then.
        """
        assert not self._reqs, "previous exchange not waited for"
        if self.world == 1:
            return x
        recv = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, group=self.group, group_peer=(self.rank + 1) % self.world),
            dist.P2POp(dist.irecv, recv, group=self.group, group_peer=(self.rank - 1) % self.world),
        ]
        self._reqs = dist.batch_isend_irecv(ops)
        return recv

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []


@dataclass(frozen=True)
class _Halves:
    """Rows of the front and back chunk of every document in a zigzag shard."""

    front: Tensor  # [T/2] int64
    back: Tensor  # [T/2] int64
    cu_half: Tensor  # [N+1], cu_seqlens of either half

    @classmethod
    def build(cls, cu_seqlens: Tensor, total: int) -> "_Halves":
        lens = cu_seqlens.diff()
        if bool((lens % 2 != 0).any()) or int(cu_seqlens[-1]) != total:
            raise ValueError(
                "zigzag shards need an even local length per document summing to the token "
                f"count ({total}); got cu_seqlens={cu_seqlens.tolist()}. Build inputs with "
                "spectrain.parallel.cp.zigzag.ZigzagLayout / shard"
            )
        half = lens // 2
        cu_half = cu_seqlens // 2
        dev = cu_seqlens.device
        n = total // 2
        doc = torch.repeat_interleave(torch.arange(len(half), device=dev), half, output_size=n)
        front = cu_seqlens[doc].long() + torch.arange(n, device=dev) - cu_half[doc]
        return cls(front=front, back=front + half[doc], cu_half=cu_half)


@dataclass(frozen=True)
class _Hop:
    """Rows of the local queries and of the held K/V that meet at one ring hop.

    ``None`` means all rows; ``cu_q`` / ``cu_k`` describe the selected rows.
    """

    q_rows: Tensor | None
    kv_rows: Tensor | None
    cu_q: Tensor
    cu_k: Tensor
    causal: bool

    @classmethod
    def at(cls, hop: int, rank: int, cu_seqlens: Tensor, h: _Halves) -> "_Hop":
        if hop == 0:
            return cls(None, None, cu_seqlens, cu_seqlens, True)
        if hop <= rank:  # K/V of an earlier rank: all queries see its front chunk only
            return cls(None, h.front, cu_seqlens, h.cu_half, False)
        # K/V of a later rank: only our back chunk sees it, all of it
        return cls(h.back, None, h.cu_half, cu_seqlens, False)


def _rows(x: Tensor, rows: Tensor | None, dim: int = 0) -> Tensor:
    return x if rows is None else x.index_select(dim, rows)


def _add_rows(acc: Tensor, rows: Tensor | None, x: Tensor, dim: int = 0) -> None:
    if rows is None:
        acc += x
    else:
        acc.index_add_(dim, rows, x.to(acc.dtype))


class ZigzagRingAttentionOps:
    """Causal attention over zigzag CP shards, with the interface of ``LocalAttentionOps``.

    Pass it as ``ops`` to ``ttt_attention`` (or ``varlen_attention``) to get CP attention:
    only the causal trunk goes round the ring; anything merged on top (the TTT branch)
    stays rank-local. ``local_ops`` computes each block (a flash-attention backend on GPU).
    """

    def __init__(self, group: dist.ProcessGroup, local_ops=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.local_ops = LocalAttentionOps() if local_ops is None else local_ops

    def _halves(self, q, k, v, cu_seqlens_q, cu_seqlens_k, causal) -> _Halves:
        if not causal:
            raise ValueError(
                "zigzag ring attention is causal-only; use LocalAttentionOps for non-causal"
            )
        assert q.dim() == 3 and k.shape == v.shape, (q.shape, k.shape, v.shape)
        assert k.shape[0] == q.shape[0], (q.shape, k.shape)
        assert q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape)
        assert cu_seqlens_q is cu_seqlens_k or torch.equal(cu_seqlens_q, cu_seqlens_k), (
            "causal attention needs the same cu_seqlens for q and k"
        )
        return _Halves.build(cu_seqlens_q, q.shape[0])

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        """``(out [T, Hq, D] in q.dtype, lse [T, Hq])`` of the local queries vs all ranks' keys."""
        h = self._halves(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
        out = lse = None
        for hop, kv in self._held_kv(torch.stack([k, v])):
            st = _Hop.at(hop, self.rank, cu_seqlens_q, h)
            out, lse = self._hop_forward(st, kv, q, out, lse, scale)
        return out.to(q.dtype), lse

    def _held_kv(self, kv: Tensor):
        """``(hop, K/V held at that hop)``; the next hop's K/V is in flight while one is computed."""
        comm = _RingComm(self.group)
        for hop in range(self.world):
            if hop + 1 < self.world:
                next_kv = comm.send_recv(kv)
            yield hop, kv
            if hop + 1 < self.world:
                comm.wait()
                kv = next_kv

    def _hop_forward(self, st: "_Hop", kv: Tensor, q: Tensor, out, lse, scale):
        """Merge one hop's block into the running ``(out, lse)``."""
        kv_s = _rows(kv, st.kv_rows, dim=1)
        block = self.local_ops.forward(_rows(q, st.q_rows), kv_s[0], kv_s[1], st.cu_q, st.cu_k, st.causal, scale)
        if st.q_rows is None:
            return merge_attn(out, lse, *block)
        out_m, lse_m = merge_attn(out[st.q_rows], lse[st.q_rows], *block)
        return out.index_copy(0, st.q_rows, out_m), lse.index_copy(0, st.q_rows, lse_m)

    def _hop_backward(self, st: "_Hop", kv: Tensor, dout, q, out, lse, scale) -> tuple[Tensor, Tensor]:
        """One hop's ``dq`` (of ``st.q_rows``) and stacked ``dK/dV`` (of ``st.kv_rows``)."""
        kv_s, r = _rows(kv, st.kv_rows, dim=1), st.q_rows
        dq_b, dk_b, dv_b = self.local_ops.backward(
            _rows(dout, r), _rows(q, r), kv_s[0], kv_s[1], _rows(out, r), _rows(lse, r),
            st.cu_q, st.cu_k, st.causal, scale,
        )
        return dq_b, torch.stack([dk_b, dv_b])

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        """``(dq, dk, dv)`` for the local shards; ``(out, lse)`` are the joint statistics."""
        h = self._halves(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
        dkv_comm = _RingComm(self.group)
        acc = _acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        for hop, kv in self._held_kv(torch.stack([k, v])):
            st = _Hop.at(hop, self.rank, cu_seqlens_q, h)
            dq_b, dkv_b = self._hop_backward(st, kv, dout, q, out, lse, scale)
            _add_rows(dq, st.q_rows, dq_b)
            # dK/dV of the held K/V: add our part to the accumulator that arrived with it.
            if hop == 0:
                dkv = dkv_b.to(acc)
            else:
                dkv_comm.wait()
                dkv = next_dkv  # noqa: F821 (bound by the previous hop, which started this wait)
                _add_rows(dkv, st.kv_rows, dkv_b, dim=1)
            # The accumulator follows its K/V to the next rank; the last hop brings it home.
            next_dkv = dkv_comm.send_recv(dkv)
        dkv_comm.wait()
        return dq.to(q.dtype), next_dkv[0].to(k.dtype), next_dkv[1].to(v.dtype)


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _ZigzagRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, ops, scale):
        out, lse = ops.forward(q, k, v, cu_seqlens, cu_seqlens, True, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.ops, ctx.scale = ops, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = ctx.ops.backward(
            dout.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, True, ctx.scale
        )
        return dq, dk, dv, None, None, None


def zigzag_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    group: dist.ProcessGroup,
    scale: float | None = None,
) -> Tensor:
    """Differentiable causal ring attention over zigzag shards; returns ``out [T, Hq, D]``.

    ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` and ``cu_seqlens`` (= ``layout.cu_seqlens_local``)
    are this rank's shard. Holds ``ZigzagRingAttentionOps`` for the backward.
    """
    return _ZigzagRingAttention.apply(q, k, v, cu_seqlens, ZigzagRingAttentionOps(group), scale)

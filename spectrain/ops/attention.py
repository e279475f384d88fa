"""Packed variable-length attention in plain torch (flash-attention math).

Layout (docs/dev/contracts.md): ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``, documents given by
``cu_seqlens_q`` / ``cu_seqlens_k``; GQA shares kv head ``j`` with q heads ``j*G..(j+1)*G-1``.

Tiling. Query rows are cut into blocks of ``block_q`` rows *across document boundaries*, so
a batch of many short documents costs ``T / block_q`` iterations, not one per document.
A query block sees one contiguous key window: from the first key of the document of its
first row to the last key its last row can see (causal: that row's own position; otherwise
the end of its document). The window is walked in chunks of ``block_k`` keys with an online
softmax; visibility inside a chunk is a ``[block_q, block_k]`` mask from document ids (and
positions when causal), skipped when the chunk is fully visible (long documents). Peak
memory is ``O(Hq * block_q * block_k)`` per step: a ``[T, T]`` score matrix never exists.

Precision: fp16 / bf16 / fp32 inputs are computed in float32, float64 inputs in float64.
``out`` has the dtype of ``q``; ``lse`` is float32 (float64 for float64 inputs).
"""

import functools
from bisect import bisect_right
from dataclasses import dataclass

import torch

from spectrain.ops import padded_flash

BLOCK_Q = 128
BLOCK_K = 1024


def _without_autocast(fn):
    """The blockwise math picks its own compute dtype (float32 for half inputs): an outer autocast (Lightning's
    bf16-mixed) would re-cast its matmuls to bf16 halfway and mix dtypes in the accumulators."""

    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        with torch.autocast(device_type=q.device.type, enabled=False):
            return fn(q, *args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class _Block:
    """Query rows ``[qs, qe)`` and the key window ``[ks, ke)`` they may see."""

    qs: int
    qe: int
    ks: int
    ke: int
    single_doc: bool


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal) -> tuple[list[int], list[int]]:
    assert q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert q.shape[2] == k.shape[2], "q and k head dims differ"
    assert q.shape[1] % k.shape[1] == 0, f"Hq={q.shape[1]} not a multiple of Hkv={k.shape[1]}"
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert len(cu_q) == len(cu_k) >= 2, "cu_seqlens_q and cu_seqlens_k need the same doc count"
    assert cu_q[0] == cu_k[0] == 0, "cu_seqlens must start at 0"
    assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0], (cu_q[-1], q.shape, cu_k[-1], k.shape)
    if causal:
        assert cu_q == cu_k, "causal attention needs equal per-document q and k lengths"
    return cu_q, cu_k


def _tile_blocks(cu_q: list[int], cu_k: list[int], causal: bool, block_q: int) -> list[_Block]:
    """Cut the query rows into blocks and find each block's contiguous key window."""
    blocks = []
    for qs in range(0, cu_q[-1], block_q):
        qe = min(qs + block_q, cu_q[-1])
        first = bisect_right(cu_q, qs) - 1  # document of row qs (skips empty documents)
        last = bisect_right(cu_q, qe - 1) - 1
        ks = cu_k[first]
        ke = cu_k[last] + (qe - cu_q[last]) if causal else cu_k[last + 1]
        blocks.append(_Block(qs, qe, ks, ke, first == last))
    return blocks


def _doc_ids(cu: torch.Tensor, n: int) -> torch.Tensor:
    """Document index of each of the n packed rows."""
    rows = torch.arange(n, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), rows, right=True)


class _Masker:
    """Visibility masks for a (query block, key chunk) pair; None when all keys are visible."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, n_q: int, n_k: int, causal: bool):
        self.doc_q = _doc_ids(cu_seqlens_q, n_q)
        self.doc_k = _doc_ids(cu_seqlens_k, n_k)
        self.causal = causal

    def __call__(self, blk: _Block, cs: int, ce: int) -> torch.Tensor | None:
        # Causal implies cu_q == cu_k, so "key position <= query position" is "col <= row".
        if blk.single_doc and (not self.causal or ce - 1 <= blk.qs):
            return None
        mask = self.doc_q[blk.qs : blk.qe, None] == self.doc_k[None, cs:ce]
        if self.causal:
            rows = torch.arange(blk.qs, blk.qe, device=mask.device)
            cols = torch.arange(cs, ce, device=mask.device)
            mask &= cols[None, :] <= rows[:, None]
        return mask


def _heads_first(x: torch.Tensor, n_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H, D] -> [Hkv, G, T, D] in the compute dtype (G = H // Hkv, 1 for k and v)."""
    t, h, d = x.shape
    return x.to(dtype).reshape(t, n_kv, h // n_kv, d).permute(1, 2, 0, 3)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[Hkv, G, T, ...] -> [T, Hkv * G, ...] (inverse of _heads_first)."""
    n_kv, g, t = x.shape[:3]
    return x.movedim(2, 0).reshape(t, n_kv * g, *x.shape[3:])


def _masked_scores(qb, kh, blk, cs, ce, masker, group) -> torch.Tensor:
    """Scores [Hkv, G*Bq, Bk] of a pre-scaled query block against keys [cs, ce), -inf if hidden."""
    s = torch.bmm(qb, kh[:, cs:ce].transpose(1, 2))
    mask = masker(blk, cs, ce)
    if mask is not None:
        s.view(s.shape[0], group, -1, ce - cs).masked_fill_(~mask, float("-inf"))
    return s


@dataclass
class _HeadsFirst:
    """The inputs of one blockwise pass, heads first in the compute dtype (q pre-scaled)."""

    cu_q: list[int]
    cu_k: list[int]
    causal: bool
    scale: float
    dtype: torch.dtype
    n_kv: int
    group: int
    dim: int
    qh: torch.Tensor
    kh: torch.Tensor
    vh: torch.Tensor
    masker: "_Masker"

    def blocks(self, block_q: int) -> list[_Block]:
        """The query blocks that see at least one key."""
        return [b for b in _tile_blocks(self.cu_q, self.cu_k, self.causal, block_q) if b.ke > b.ks]


def _heads_first_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale) -> _HeadsFirst:
    cu_q, cu_k = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cdt = _compute_dtype(q.dtype)
    n_kv = k.shape[1]
    return _HeadsFirst(cu_q, cu_k, causal, scale, cdt, n_kv, q.shape[1] // n_kv, q.shape[2],
                       _heads_first(q, n_kv, cdt) * scale,
                       _heads_first(k, n_kv, cdt).squeeze(1).contiguous(),
                       _heads_first(v, n_kv, cdt).squeeze(1).contiguous(),
                       _Masker(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal))


@torch.no_grad()
@_without_autocast
def attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [Tq, Hq, D] in q.dtype, lse [Tq, Hq])``; rows seeing no key: 0 and -inf."""
    x = _heads_first_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    n_kv, group, dim, qh, kh, vh, masker = x.n_kv, x.group, x.dim, x.qh, x.kh, x.vh, x.masker
    out = qh.new_zeros(n_kv, group, q.shape[0], dim)
    lse = qh.new_full((n_kv, group, q.shape[0]), float("-inf"))

    for blk in x.blocks(block_q):
        qb = qh[:, :, blk.qs : blk.qe].reshape(n_kv, -1, dim)
        row_max = qb.new_full(qb.shape[:2], float("-inf"))
        row_sum = qb.new_zeros(qb.shape[:2])
        acc = torch.zeros_like(qb)
        for cs in range(blk.ks, blk.ke, block_k):
            ce = min(cs + block_k, blk.ke)
            s = _masked_scores(qb, kh, blk, cs, ce, masker, group)
            new_max = torch.maximum(row_max, s.amax(-1))
            safe_max = torch.where(new_max == float("-inf"), 0.0, new_max)
            p = s.sub_(safe_max.unsqueeze(-1)).exp_()
            alpha = torch.exp(row_max - safe_max)
            row_sum = row_sum * alpha + p.sum(-1)
            acc = torch.baddbmm(acc * alpha.unsqueeze(-1), p, vh[:, cs:ce])
            row_max = new_max
        seen = row_sum > 0
        acc /= torch.where(seen, row_sum, 1.0).unsqueeze(-1)
        block_lse = torch.where(seen, row_max + torch.log(row_sum), float("-inf"))
        out[:, :, blk.qs : blk.qe] = acc.view(n_kv, group, -1, dim)
        lse[:, :, blk.qs : blk.qe] = block_lse.view(n_kv, group, -1)

    return _tokens_first(out).to(q.dtype), _tokens_first(lse)


@torch.no_grad()
@_without_autocast
def attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` using ``(out, lse)`` as the softmax statistics.

    ``(out, lse)`` may be the joint result of several merged attention parts (ring steps,
    TTT trunk + branch): ``P = exp(s - lse)`` and ``D = rowsum(dout * out)`` are then the
    joint probabilities and correction, and this returns exactly this part's gradients.
    """
    assert dout.shape == out.shape == q.shape and lse.shape == q.shape[:2]
    x = _heads_first_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    n_kv, group, dim, qh, kh, vh, masker, cdt = x.n_kv, x.group, x.dim, x.qh, x.kh, x.vh, x.masker, x.dtype
    doh = _heads_first(dout, n_kv, cdt)
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)  # D = rowsum(dO * O), [T, Hq]
    delta = delta.view(-1, n_kv, group).permute(1, 2, 0)
    lse_h = lse.to(cdt).reshape(-1, n_kv, group).permute(1, 2, 0)
    lse_h = torch.where(lse_h == float("-inf"), 0.0, lse_h)  # such rows have s = -inf: P = 0

    dq = torch.zeros_like(qh)
    dk = torch.zeros_like(kh)
    dv = torch.zeros_like(vh)

    for blk in x.blocks(block_q):
        rows = slice(blk.qs, blk.qe)
        qb = qh[:, :, rows].reshape(n_kv, -1, dim)
        dob = doh[:, :, rows].reshape(n_kv, -1, dim)
        lse_b = lse_h[:, :, rows].reshape(n_kv, -1, 1)
        delta_b = delta[:, :, rows].reshape(n_kv, -1, 1)
        dqb = torch.zeros_like(qb)
        for cs in range(blk.ks, blk.ke, block_k):
            ce = min(cs + block_k, blk.ke)
            p = _masked_scores(qb, kh, blk, cs, ce, masker, group).sub_(lse_b).exp_()
            dv[:, cs:ce] += torch.bmm(p.transpose(1, 2), dob)
            ds = torch.bmm(dob, vh[:, cs:ce].transpose(1, 2)).sub_(delta_b).mul_(p)
            dqb.baddbmm_(ds, kh[:, cs:ce])
            dk[:, cs:ce] += torch.bmm(ds.transpose(1, 2), qb)  # qb carries the scale
        dq[:, :, rows] = dqb.view(n_kv, group, -1, dim)

    dq = _tokens_first(dq * x.scale).to(q.dtype)
    dk = _tokens_first(dk.unsqueeze(1)).to(k.dtype)
    dv = _tokens_first(dv.unsqueeze(1)).to(v.dtype)
    return dq, dk, dv


class LocalAttentionOps:
    """Single-device attention ops: the object the model, TTT and ring code pass around.

    Causal calls on CPU whose documents pad cheaply go to torch's fused flash kernel
    (`padded_flash`); everything else takes the blockwise path above.

    Ring attention provides another class with the same ``forward`` / ``backward``.
    """

    def __init__(self, block_q: int = BLOCK_Q, block_k: int = BLOCK_K, use_fused: bool = True):
        self.block_q = block_q
        self.block_k = block_k
        self.use_fused = use_fused

    def _fused(self, q, cu_seqlens_q, causal) -> list[int] | None:
        """Causal CPU batches of similar-length documents take torch's fused flash kernel."""
        if not (self.use_fused and causal):
            return None
        cu = cu_seqlens_q.tolist()
        return cu if padded_flash.usable(q, cu) else None

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        cu = self._fused(q, cu_seqlens_q, causal)
        if cu is not None:
            _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
            return padded_flash.forward(q, k, v, cu, scale)
        return attn_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale,
            block_q=self.block_q, block_k=self.block_k,
        )

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        cu = self._fused(q, cu_seqlens_q, causal)
        if cu is not None:
            return padded_flash.backward(dout, q, k, v, out, lse, cu, scale)
        return attn_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale,
            block_q=self.block_q, block_k=self.block_k,
        )


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, causal, scale, ops):
        out, lse = ops.forward(q, k, v, cu_seqlens, cu_seqlens, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.causal, ctx.scale, ctx.ops = causal, scale, ops
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = ctx.ops.backward(
            dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, ctx.causal, ctx.scale
        )
        return dq, dk, dv, None, None, None, None


def varlen_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    ops=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable packed attention returning ``(out, lse)``; ``lse`` carries no gradient."""
    ops = LocalAttentionOps() if ops is None else ops
    q, k, v = common_dtype(q, k, v)
    return _VarlenAttention.apply(q, k, v, cu_seqlens, causal, scale, ops)


def common_dtype(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in their widest dtype: under autocast, rotary tables and norms (float32) promote q and k while
    v stays bf16, and the kernels take one dtype."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return [t.to(dtype) for t in tensors]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    ops=None,
) -> torch.Tensor:
    """Differentiable packed attention (same cu_seqlens for q and k); returns ``out``."""
    return varlen_attention_with_lse(q, k, v, cu_seqlens, causal, scale, ops)[0]

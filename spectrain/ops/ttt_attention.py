"""EAGLE-3 training-time-test (TTT) branch attention (docs/cotraining.md).

In pass ``d`` the query at anchor ``i`` attends to the causal trunk of pass-1 keys of its
document plus one diagonal key per earlier pass ``p = 2..d`` at the same anchor ``i``.
The trunk goes through ``ops`` (local attention, or ring attention under context
parallel); the ``d - 1`` diagonal keys are a per-row softmax in closed form, merged into
the trunk by log-sum-exp. Memory is ``O(T * d)``: the ``[T, d * T]`` staircase mask of the
dense formulation never exists. Ops with a fused ``ttt_forward`` / ``ttt_backward`` (the Triton
kernels) take both parts in one online softmax instead; ring ops never have them.
"""

import torch

from spectrain.ops.attention import LocalAttentionOps, common_dtype
from spectrain.ops.lse_merge import merge_attn


def _grouped(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[T, Hq, ...] -> [T, Hkv, G, ...]: q head j*G+g is served by kv head j."""
    return x.reshape(x.shape[0], n_kv, -1, *x.shape[2:])


def _branch_scores(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Diagonal scores ``s[p, t, j, g] = scale * q[t, j, g] . keys[p, t, j]``."""
    return torch.einsum("tjgd,ptjd->ptjg", q, keys) * scale


def _branch_forward(q, keys, values, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the diagonal keys alone: ``(out [T, Hkv, G, D], lse [T, Hkv, G])``."""
    s = _branch_scores(q, keys, scale)
    lse = torch.logsumexp(s, dim=0)
    return torch.einsum("ptjg,ptjd->tjgd", torch.exp(s - lse), values), lse


def _branch_backward(dout, q, keys, values, out, lse, scale):
    """Closed-form gradients of the diagonal part given the joint ``(out, lse)``.

    ``P_p = exp(s_p - lse)``, ``D = sum(dO * O)``, ``dV_p = P_p dO``,
    ``dS_p = P_p (dO . v_p - D)``, ``dq = scale sum_p dS_p k_p``, ``dk_p = scale dS_p q``;
    the einsums over ``g`` sum the GQA groups.
    Returns dq ``[T, Hkv, G, D]`` and dk, dv ``[P, T, Hkv, D]``.
    """
    cdt, n_kv = lse.dtype, keys.shape[2]
    dout, q, out = (_grouped(x.to(cdt), n_kv) for x in (dout, q, out))
    keys, values, lse = keys.to(cdt), values.to(cdt), _grouped(lse, n_kv)

    p = torch.exp(_branch_scores(q, keys, scale) - lse)  # [P, T, Hkv, G]
    delta = (dout * out).sum(-1)  # [T, Hkv, G]
    ds = p * (torch.einsum("tjgd,ptjd->ptjg", dout, values) - delta)
    dq = scale * torch.einsum("ptjg,ptjd->tjgd", ds, keys)
    dk = scale * torch.einsum("ptjg,tjgd->ptjd", ds, q)
    dv = torch.einsum("ptjg,tjgd->ptjd", p, dout)
    return dq, dk, dv


def _trunk_and_branch_forward(q, keys, values, cu_seqlens, scale, ops):
    """The trunk through ``ops`` (local or ring), the diagonal keys in closed form, merged by LSE."""
    out, lse = ops.forward(q, keys[0], values[0], cu_seqlens, cu_seqlens, True, scale)
    if len(keys) > 1:
        cdt, n_kv = lse.dtype, keys[0].shape[1]
        out_b, lse_b = _branch_forward(
            _grouped(q.to(cdt), n_kv),
            torch.stack(keys[1:]).to(cdt),
            torch.stack(values[1:]).to(cdt),
            scale,
        )
        out, lse = merge_attn(out, lse, out_b.flatten(1, 2), lse_b.flatten(1, 2))
        out = out.to(q.dtype)
    return out, lse


def _trunk_and_branch_backward(dout, q, keys, values, out, lse, cu_seqlens, scale, ops):
    dq, dk0, dv0 = ops.backward(
        dout, q, keys[0], values[0], out, lse, cu_seqlens, cu_seqlens, True, scale
    )
    dks, dvs = [dk0], [dv0]
    if len(keys) > 1:
        dq_b, dk_b, dv_b = _branch_backward(
            dout, q, torch.stack(keys[1:]), torch.stack(values[1:]), out, lse, scale
        )
        dq = (dq.to(dq_b.dtype) + dq_b.flatten(1, 2)).to(q.dtype)
        dks += [g.to(k.dtype) for g, k in zip(dk_b.unbind(0), keys[1:])]
        dvs += [g.to(v.dtype) for g, v in zip(dv_b.unbind(0), values[1:])]
    return dq, dks, dvs


def fused_ttt_ops(ops, device: torch.device):
    """The ops that run trunk and branch in one kernel on `device` (Triton's; `auto` offers them on CUDA), or
    None: ops without ``ttt_ops`` (torch, ring attention under CP, ...) take trunk + closed-form branch."""
    pick = getattr(ops, "ttt_ops", None)
    return pick(device) if pick is not None else None


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cu_seqlens, scale, ops, n_pass, *kv):
        keys, values = kv[:n_pass], kv[n_pass:]
        fused = fused_ttt_ops(ops, q.device)
        if fused is not None:  # trunk and branch in one fused kernel
            out, lse = fused.ttt_forward(q, list(keys), list(values), cu_seqlens, scale)
        else:
            out, lse = _trunk_and_branch_forward(q, keys, values, cu_seqlens, scale, ops)
        ctx.save_for_backward(q, cu_seqlens, out, lse, *kv)
        ctx.scale, ctx.ops, ctx.fused, ctx.n_pass = scale, ops, fused, n_pass
        return out

    @staticmethod
    def backward(ctx, dout):
        q, cu_seqlens, out, lse, *kv = ctx.saved_tensors
        keys, values = kv[: ctx.n_pass], kv[ctx.n_pass :]
        if ctx.fused is not None:
            dq, dks, dvs = ctx.fused.ttt_backward(
                dout, q, list(keys), list(values), out, lse, cu_seqlens, ctx.scale
            )
        else:
            dq, dks, dvs = _trunk_and_branch_backward(
                dout, q, keys, values, out, lse, cu_seqlens, ctx.scale, ctx.ops
            )
        return dq, None, None, None, None, *dks, *dvs


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    ops=None,
) -> torch.Tensor:
    """Branch attention of TTT pass ``d = len(keys)``; returns ``out [T, Hq, D]``.

    ``keys[0] / values[0]``: pass-1 keys/values ``[T, Hkv, D]``, seen causally within each
    document. ``keys[p] / values[p]`` (p >= 1): pass-(p+1) keys, seen only at the same
    anchor. ``d = 1`` is plain causal attention. ``ops`` computes the trunk
    (``LocalAttentionOps()`` by default; a ring-attention ops object under CP).
    """
    assert len(keys) == len(values) >= 1, (len(keys), len(values))
    assert all(k.shape == keys[0].shape for k in (*keys, *values)), "keys/values shapes differ"
    assert q.shape[0] == keys[0].shape[0], (q.shape, keys[0].shape)
    assert q.shape[2] == keys[0].shape[2], (q.shape, keys[0].shape)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ops = LocalAttentionOps() if ops is None else ops
    q, *kv = common_dtype(q, *keys, *values)
    return _TTTAttention.apply(q, cu_seqlens, scale, ops, len(keys), *kv)

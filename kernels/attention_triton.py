"""Triton forward kernel for local causal packed-varlen attention (GPU fast path).

Same contract as ``spectrain.ops.attention.attn_forward(..., causal=True)`` with equal
``cu_seqlens`` for q and k: returns ``(out [T, Hq, D] in q.dtype, lse [T, Hq] float32)``.
One program per (query block of one document, query head): the document's key blocks up
to the diagonal are walked with an online softmax in base 2 (``exp2``). Forward only; the
backward stays ``attn_backward`` (it takes the returned ``(out, lse)``).

fp32 inputs go through ``tl.dot`` at the backend's default precision (TF32 on NVIDIA).
Tested under ``TRITON_INTERPRET=1`` on CPU.
"""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _causal_varlen_fwd(
    Q, K, V, O, LSE, CU,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh,
    scale_log2, head_dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m, doc, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(CU + doc)
    seqlen = tl.load(CU + doc + 1) - start
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen:
        return
    kv_head = head // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen
    d_ok = offs_d < head_dim

    q_ptrs = Q + (start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    hi = tl.minimum(m0 + BLOCK_M, seqlen)  # causal: keys up to the block's last row
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < seqlen
        k_ptrs = K + (start + cols)[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]
        k = tl.load(k_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k) * scale_log2
        visible = (cols[None, :] <= offs_m[:, None]) & col_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Padding rows past the document see key 0, so every row's max stays finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V + (start + cols)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_ptrs = O + (start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # back to natural log
    tl.store(LSE + (start + offs_m) * stride_lt + head * stride_lh, lse, mask=row_ok)


def triton_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    *,
    block_m: int = 64,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal packed attention ``(out, lse)``; fp16 / bf16 / fp32 inputs."""
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert q.dim() == 3 and k.shape == v.shape and k.shape[0] == q.shape[0], (q.shape, k.shape)
    assert q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head dim must be contiguous"
    n_tokens, n_q, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    n_docs = cu.numel() - 1
    max_len = int((cu[1:] - cu[:-1]).max()) if n_docs > 0 else 0

    out = torch.empty_like(q)
    lse = torch.empty(n_tokens, n_q, device=q.device, dtype=torch.float32)
    if max_len == 0:
        return out, lse
    grid = (triton.cdiv(max_len, block_m), n_docs, n_q)
    _causal_varlen_fwd[grid](
        q, k, v, out, lse, cu,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        scale * math.log2(math.e), head_dim,
        GROUP=n_q // k.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out, lse

"""Triton flash attention over packed documents: plain varlen attention and the fused TTT branch attention.

``triton_attn_forward`` / ``triton_attn_backward`` have exactly the contract of
``spectrain.ops.attention.attn_forward`` / ``attn_backward`` (docs/dev/contracts.md): packed
documents through ``cu_seqlens_q`` / ``cu_seqlens_k``, GQA, causal (equal q/k document lengths)
or not (any lengths, ring attention's off-diagonal blocks); rows that see no key give out 0 and
lse -inf; the backward takes the given ``(out, lse)`` as the softmax statistics, so it returns
one part's gradients when they are the joint result of merged parts.

``triton_ttt_forward`` / ``triton_ttt_backward`` are ``spectrain.ops.ttt_attention.ttt_attention``
in one kernel: the causal trunk of pass-1 keys and the diagonal key of every later pass go into
ONE online softmax (the branch keys are just ``P - 1`` extra scores per row), so neither the
``[T, P*T]`` staircase nor a second ``(out, lse)`` to merge ever exists.

Kernels (flash-attention 2, softmax in base 2):
- ``_fwd``: one program per (query block of a document, q head) walks the key blocks it can see;
  causal programs stop at the diagonal, then add the branch keys of its rows.
- ``_bwd_dq``: the same walk for dq (``P = exp(s - lse)``, ``dS = P (dO.v - D)``).
- ``_bwd_dkdv``: one program per (key block of a document, kv head) loops over the q heads of its
  GQA group and the query blocks that see it: dk / dv are summed over the group without atomics.
- ``_bwd_branch_dkdv``: the branch keys' gradients, row-local, one program per (row block, pass, kv head).
Every walk runs its fully visible blocks unmasked and masks only the diagonal / document-end blocks.

Precision: scores, softmax statistics and accumulators are float32. bf16 / fp16 inputs feed
``tl.dot`` in their own dtype (probabilities cast to it, as in flash-attention); float32 inputs use
``input_precision="ieee"``: on NVIDIA, ``tl.dot`` would otherwise run float32 as TF32 (10-bit
mantissa, ~1e-3 off the float64 reference). Runs compiled on CUDA and under ``TRITON_INTERPRET=1``
on CPU (set before this module is imported).
"""

import os

import torch
import triton
import triton.language as tl

from spectrain.ops.attention import _without_autocast

# Launch defaults, checked for spills and shared memory by compiling for sm_90 / sm_80 (tests/triton_compile.py).
# float32 tiles are 16 x 16: an ieee tl.dot runs on the FMA units, each thread holding whole rows of both
# operands, and 64 x 64 float32 tiles at head_dim 128 spill kilobytes per thread.
BLOCK_M = 64
BLOCK_N = 64
FP32_BLOCK = 16
NUM_WARPS = 8  # 4 spill at head_dim 128 in 16 bits: the backward on sm_90, also the forward on sm_80
LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)
# The interpreter keeps bfloat16 as uint16 (numpy has no bf16) and its tl.dot multiplies those bit patterns:
# there the tiles go to float32 first, exact for 16-bit inputs (Triton 3.9).
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _dot(a, b):
    """Matrix product at full precision for float32 tiles (ignored for 16-bit ones)."""
    if INTERPRETED:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_rows(ptr, rows, row_ok, head, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, offs_d):
    """A [len(rows), BLOCK_D] tile of a contiguous [T, N_HEADS, HEAD_DIM] tensor (zeros outside)."""
    offs = rows.to(tl.int64)[:, None] * (N_HEADS * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :]
    return tl.load(ptr + offs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _store_rows(ptr, x, rows, row_ok, head, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, offs_d):
    offs = rows.to(tl.int64)[:, None] * (N_HEADS * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _load_row_stats(LSE, DELTA, rows, row_ok, head, N_HEADS: tl.constexpr):
    """Per-row ``lse`` in base 2 (0 for rows that see nothing: their scores are all -inf) and ``D``."""
    offs = rows.to(tl.int64) * N_HEADS + head
    lse = tl.load(LSE + offs, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    return lse2, tl.load(DELTA + offs, mask=row_ok, other=0.0)


@triton.jit
def _doc(CU, doc):
    start = tl.load(CU + doc)
    return start, tl.load(CU + doc + 1) - start


@triton.jit
def _query_block(CU_Q, CU_K, HQ: tl.constexpr, HKV: tl.constexpr, BLOCK_M: tl.constexpr):
    """What a (query block, document, q head) program works on: first row, documents, GQA kv head."""
    m_blk, doc, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, len_q = _doc(CU_Q, doc)
    k_start, len_k = _doc(CU_K, doc)
    return m_blk * BLOCK_M, q_start, len_q, k_start, len_k, head, head // (HQ // HKV)


@triton.jit
def _load_branch(KB, VB, p, branch_stride, rows, row_ok, kv_head, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                 offs_d):
    """Pass ``p``'s branch keys and values at ``rows`` (one per row), in float32."""
    kb = _load_rows(KB + p * branch_stride, rows, row_ok, kv_head, HKV, HEAD_DIM, offs_d)
    vb = _load_rows(VB + p * branch_stride, rows, row_ok, kv_head, HKV, HEAD_DIM, offs_d)
    return kb.to(tl.float32), vb.to(tl.float32)


@triton.jit
def _key_range(m0, len_q, len_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks seen by query rows ``[m0, m0 + BLOCK_M)``: ``[0, full)`` entirely, ``[full, end)`` in part."""
    if CAUSAL:  # len_q == len_k: keys before the block's first row are seen by all its rows
        full = (m0 // BLOCK_N) * BLOCK_N
        end = tl.minimum(m0 + BLOCK_M, len_q)
    else:
        full = (len_k // BLOCK_N) * BLOCK_N
        end = len_k
    return full, end


@triton.jit
def _visible(rows, cols, len_k, CAUSAL: tl.constexpr):
    ok = (cols < len_k)[None, :]
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None])
    return ok


@triton.jit
def _fwd_keys(q, K, V, k_start, kv_head, rows, offs_d, len_k, lo, hi, m_i, l_i, acc, scale_log2,
              HKV: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Online softmax over key blocks ``[lo, hi)``. Every row sees a key of the first block it
    meets (causal: key 0 or one at/before its block; non-causal: all of them), so ``m_i`` is finite."""
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < len_k
        k = _load_rows(K, k_start + cols, col_ok, kv_head, HKV, HEAD_DIM, offs_d)
        s = _dot(q, tl.trans(k)) * scale_log2
        if MASKED:
            s = tl.where(_visible(rows, cols, len_k, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(V, k_start + cols, col_ok, kv_head, HKV, HEAD_DIM, offs_d)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _fwd(Q, K, V, KB, VB, O, LSE, CU_Q, CU_K, scale, n_branch, branch_stride,
         HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    m0, q_start, len_q, k_start, len_k, head, kv_head = _query_block(CU_Q, CU_K, HQ, HKV, BLOCK_M)
    if m0 >= len_q:
        return
    scale_log2 = scale * LOG2E
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q, q_start + rows, row_ok, head, HQ, HEAD_DIM, offs_d)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = _key_range(m0, len_q, len_k, CAUSAL, BLOCK_M, BLOCK_N)
    m_i, l_i, acc = _fwd_keys(q, K, V, k_start, kv_head, rows, offs_d, len_k, 0, full, m_i, l_i, acc,
                              scale_log2, HKV, HEAD_DIM, CAUSAL, False, BLOCK_N)
    m_i, l_i, acc = _fwd_keys(q, K, V, k_start, kv_head, rows, offs_d, len_k, full, end, m_i, l_i, acc,
                              scale_log2, HKV, HEAD_DIM, CAUSAL, True, BLOCK_N)

    qf = q.to(tl.float32)
    for p in range(n_branch):  # TTT: one diagonal key per earlier pass, same online softmax
        kb, vb = _load_branch(KB, VB, p, branch_stride, q_start + rows, row_ok, kv_head, HKV, HEAD_DIM, offs_d)
        s = tl.sum(qf * kb, 1) * scale_log2
        m_new = tl.maximum(m_i, s)
        pb = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + pb
        acc = acc * alpha[:, None] + pb[:, None] * vb
        m_i = m_new

    seen = l_i > 0  # only a document without keys leaves a row unseen
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    _store_rows(O, out, q_start + rows, row_ok, head, HQ, HEAD_DIM, offs_d)
    tl.store(LSE + (q_start + rows).to(tl.int64) * HQ + head, lse, mask=row_ok)


@triton.jit
def _branch_grads(qf, dof, kb, vb, lse2, delta, scale_log2):
    """Branch key of one pass at each row: probability ``P`` and ``dS = P (dO.v - D)``."""
    pb = tl.exp2(tl.sum(qf * kb, 1) * scale_log2 - lse2)
    return pb, pb * (tl.sum(dof * vb, 1) - delta)


@triton.jit
def _dq_keys(q, do, lse2, delta, K, V, k_start, kv_head, rows, offs_d, len_k, lo, hi, dq, scale_log2,
             HKV: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
             BLOCK_N: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < len_k
        k = _load_rows(K, k_start + cols, col_ok, kv_head, HKV, HEAD_DIM, offs_d)
        v = _load_rows(V, k_start + cols, col_ok, kv_head, HKV, HEAD_DIM, offs_d)
        s = _dot(q, tl.trans(k)) * scale_log2
        if MASKED:
            s = tl.where(_visible(rows, cols, len_k, CAUSAL), s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        ds = p * (_dot(do, tl.trans(v)) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _bwd_dq(Q, K, V, KB, VB, DO, LSE, DELTA, DQ, CU_Q, CU_K, scale, n_branch, branch_stride,
            HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    m0, q_start, len_q, k_start, len_k, head, kv_head = _query_block(CU_Q, CU_K, HQ, HKV, BLOCK_M)
    if m0 >= len_q:
        return
    scale_log2 = scale * LOG2E
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q, q_start + rows, row_ok, head, HQ, HEAD_DIM, offs_d)
    do = _load_rows(DO, q_start + rows, row_ok, head, HQ, HEAD_DIM, offs_d)
    lse2, delta = _load_row_stats(LSE, DELTA, q_start + rows, row_ok, head, HQ)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = _key_range(m0, len_q, len_k, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_keys(q, do, lse2, delta, K, V, k_start, kv_head, rows, offs_d, len_k, 0, full, dq, scale_log2,
                  HKV, HEAD_DIM, CAUSAL, False, BLOCK_N)
    dq = _dq_keys(q, do, lse2, delta, K, V, k_start, kv_head, rows, offs_d, len_k, full, end, dq, scale_log2,
                  HKV, HEAD_DIM, CAUSAL, True, BLOCK_N)

    qf, dof = q.to(tl.float32), do.to(tl.float32)
    for p in range(n_branch):
        kb, vb = _load_branch(KB, VB, p, branch_stride, q_start + rows, row_ok, kv_head, HKV, HEAD_DIM, offs_d)
        _, ds = _branch_grads(qf, dof, kb, vb, lse2, delta, scale_log2)
        dq += ds[:, None] * kb
    _store_rows(DQ, dq * scale, q_start + rows, row_ok, head, HQ, HEAD_DIM, offs_d)


@triton.jit
def _dkdv_queries(k, v, Q, DO, LSE, DELTA, q_start, head, cols, offs_d, len_q, lo, hi, dk, dv, scale_log2,
                  HQ: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
    """Accumulate one key block's dk, dv over query blocks ``[lo, hi)`` of one q head (transposed
    scores ``[BLOCK_N, BLOCK_M]``). Rows past the document load as zeros (dO = 0): they add nothing."""
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < len_q
        q = _load_rows(Q, q_start + rows, row_ok, head, HQ, HEAD_DIM, offs_d)
        do = _load_rows(DO, q_start + rows, row_ok, head, HQ, HEAD_DIM, offs_d)
        lse2, delta = _load_row_stats(LSE, DELTA, q_start + rows, row_ok, head, HQ)
        s_t = _dot(k, tl.trans(q)) * scale_log2
        if MASKED:  # causal diagonal
            s_t = tl.where(cols[:, None] <= rows[None, :], s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse2[None, :])
        dv += _dot(p_t.to(do.dtype), do)
        ds_t = p_t * (_dot(v, tl.trans(do)) - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, scale,
              HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    n_blk, doc, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_start, len_k = _doc(CU_K, doc)
    n0 = n_blk * BLOCK_N
    if n0 >= len_k:
        return
    q_start, len_q = _doc(CU_Q, doc)
    scale_log2 = scale * LOG2E
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < len_k
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K, k_start + cols, col_ok, kv_head, HKV, HEAD_DIM, offs_d)
    v = _load_rows(V, k_start + cols, col_ok, kv_head, HKV, HEAD_DIM, offs_d)

    # Query blocks that see this key block: causal ones from its diagonal on, [lo, diag) in part.
    if CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M
        diag = tl.minimum(tl.cdiv(n0 + BLOCK_N, BLOCK_M) * BLOCK_M, len_q)
    else:
        lo = 0
        diag = 0
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(HQ // HKV):
        head = kv_head * (HQ // HKV) + g
        dk, dv = _dkdv_queries(k, v, Q, DO, LSE, DELTA, q_start, head, cols, offs_d, len_q, lo, diag, dk, dv,
                               scale_log2, HQ, HEAD_DIM, True, BLOCK_M)
        dk, dv = _dkdv_queries(k, v, Q, DO, LSE, DELTA, q_start, head, cols, offs_d, len_q, diag, len_q, dk, dv,
                               scale_log2, HQ, HEAD_DIM, False, BLOCK_M)
    _store_rows(DK, dk * scale, k_start + cols, col_ok, kv_head, HKV, HEAD_DIM, offs_d)
    _store_rows(DV, dv, k_start + cols, col_ok, kv_head, HKV, HEAD_DIM, offs_d)


@triton.jit
def _bwd_branch_dkdv(Q, KB, VB, DO, LSE, DELTA, DKB, DVB, n_rows, scale, branch_stride,
                     HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    m_blk, p, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    scale_log2 = scale * LOG2E
    kb, vb = _load_branch(KB, VB, p, branch_stride, rows, row_ok, kv_head, HKV, HEAD_DIM, offs_d)
    dk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for g in range(HQ // HKV):
        head = kv_head * (HQ // HKV) + g
        qf = _load_rows(Q, rows, row_ok, head, HQ, HEAD_DIM, offs_d).to(tl.float32)
        dof = _load_rows(DO, rows, row_ok, head, HQ, HEAD_DIM, offs_d).to(tl.float32)
        lse2, delta = _load_row_stats(LSE, DELTA, rows, row_ok, head, HQ)
        pb, ds = _branch_grads(qf, dof, kb, vb, lse2, delta, scale_log2)
        dk += ds[:, None] * qf
        dv += pb[:, None] * dof
    _store_rows(DKB + p * branch_stride, dk * scale, rows, row_ok, kv_head, HKV, HEAD_DIM, offs_d)
    _store_rows(DVB + p * branch_stride, dv, rows, row_ok, kv_head, HKV, HEAD_DIM, offs_d)


def _check_shapes(q, k, v, branch_keys, branch_values) -> None:
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}"
    assert q.dim() == 3 and k.shape == v.shape and k.dim() == 3, (q.shape, k.shape, v.shape)
    assert q.shape[2] == k.shape[2], "q and k head dims differ"
    assert q.shape[1] % k.shape[1] == 0, f"Hq={q.shape[1]} not a multiple of Hkv={k.shape[1]}"
    assert all(t.dtype == q.dtype for t in (k, v, *branch_keys, *branch_values)), "inputs need one dtype"
    assert all(t.shape == (q.shape[0], *k.shape[1:]) for t in (*branch_keys, *branch_values)), "branch shapes"


def _doc_lengths(cu_q, cu_k, q, k, causal) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """int32 cu_seqlens on q's device and the longest q / k documents, checked with one host sync."""
    cu_q, cu_k = (cu.to(device=q.device, dtype=torch.int32) for cu in (cu_q, cu_k))
    assert cu_q.numel() == cu_k.numel() >= 2, "cu_seqlens_q and cu_seqlens_k need the same doc count"
    assert cu_q.numel() <= 65536, "at most 65535 documents per call (CUDA grid limit)"
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    stats = torch.stack([len_q.max(), len_k.max(), cu_q[0], cu_k[0], cu_q[-1], cu_k[-1],
                         (len_q != len_k).any().int()]).tolist()
    max_q, max_k, first_q, first_k, total_q, total_k, unequal = stats
    assert first_q == first_k == 0, "cu_seqlens must start at 0"
    assert (total_q, total_k) == (q.shape[0], k.shape[0]), (total_q, q.shape, total_k, k.shape)
    assert not (causal and unequal), "causal attention needs equal per-document q and k lengths"
    return cu_q, cu_k, max_q, max_k


def _branch_stack(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The branch keys (or values) as one [P - 1, T, Hkv, D] tensor; ``like`` stands in when there are none
    (the kernels never read it then)."""
    return torch.stack(tensors) if tensors else like


def _blocks(dtype: torch.dtype, block_m: int | None, block_n: int | None) -> tuple[int, int]:
    """The given tile sizes; None: ``BLOCK_M x BLOCK_N``, or ``FP32_BLOCK`` square for float32."""
    fp32 = dtype == torch.float32
    return block_m or (FP32_BLOCK if fp32 else BLOCK_M), block_n or (FP32_BLOCK if fp32 else BLOCK_N)


def _meta(q, k, causal, block_m, block_n) -> dict:
    """Compile-time sizes and launch options shared by the kernels."""
    return dict(HQ=q.shape[1], HKV=k.shape[1], HEAD_DIM=q.shape[2], CAUSAL=causal, BLOCK_M=block_m,
                BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(q.shape[2])), num_warps=NUM_WARPS,
                num_stages=2 if q.dtype == torch.float32 else 3)  # float32 tiles: twice the shared memory


def _forward(q, k, v, branch_keys, branch_values, cu_q, cu_k, causal, scale, block_m, block_n):
    _check_shapes(q, k, v, branch_keys, branch_values)
    cu_q, cu_k, max_q, _ = _doc_lengths(cu_q, cu_k, q, k, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    block_m, block_n = _blocks(q.dtype, block_m, block_n)
    q, k, v = (t.contiguous() for t in (q, k, v))
    kb, vb = _branch_stack(branch_keys, k), _branch_stack(branch_values, v)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=q.device, dtype=torch.float32)
    if max_q > 0:
        grid = (triton.cdiv(max_q, block_m), cu_q.numel() - 1, q.shape[1])
        _fwd[grid](q, k, v, kb, vb, out, lse, cu_q, cu_k, scale, len(branch_keys), k.numel(),
                   **_meta(q, k, causal, block_m, block_n))
    return out, lse


def _backward(dout, q, k, v, out, lse, branch_keys, branch_values, cu_q, cu_k, causal, scale, block_m, block_n):
    _check_shapes(q, k, v, branch_keys, branch_values)
    assert dout.shape == out.shape == q.shape and lse.shape == q.shape[:2], (dout.shape, out.shape, lse.shape)
    cu_q, cu_k, max_q, max_k = _doc_lengths(cu_q, cu_k, q, k, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    block_m, block_n = _blocks(q.dtype, block_m, block_n)
    q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))
    kb, vb = _branch_stack(branch_keys, k), _branch_stack(branch_values, v)
    lse = lse.float().contiguous()
    delta = (dout.float() * out.float()).sum(-1)  # D = rowsum(dO * O): the joint softmax correction
    n_docs, meta = cu_q.numel() - 1, _meta(q, k, causal, block_m, block_n)

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if max_q > 0:
        _bwd_dq[(triton.cdiv(max_q, block_m), n_docs, q.shape[1])](
            q, k, v, kb, vb, dout, lse, delta, dq, cu_q, cu_k, scale, len(branch_keys), k.numel(), **meta)
    if max_k > 0:
        # query steps of half a block: k, v, dk, dv stay in registers across them (no spills at head_dim 128)
        _bwd_dkdv[(triton.cdiv(max_k, block_n), n_docs, k.shape[1])](
            q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k, scale, **{**meta, "BLOCK_M": max(16, block_m // 2)})
    if not branch_keys:
        return dq, dk, dv, [], []
    dkb, dvb = torch.empty_like(kb), torch.empty_like(vb)
    meta = {key: val for key, val in meta.items() if key not in ("CAUSAL", "BLOCK_N")}
    _bwd_branch_dkdv[(triton.cdiv(q.shape[0], block_m), len(branch_keys), k.shape[1])](
        q, kb, vb, dout, lse, delta, dkb, dvb, q.shape[0], scale, k.numel(), **meta)
    return dq, dk, dv, list(dkb.unbind(0)), list(dvb.unbind(0))


@_without_autocast
def triton_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [Tq, Hq, D] in q.dtype, lse [Tq, Hq] float32)``; rows seeing no key: 0 and -inf.
    ``block_m`` x ``block_n``: the query x key tile, None for the dtype's default (64 x 64, float32 16 x 16)."""
    return _forward(q, k, v, [], [], cu_seqlens_q, cu_seqlens_k, causal, scale, block_m, block_n)


@_without_autocast
def triton_attn_backward(
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
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` with ``(out, lse)`` as the softmax statistics; dk, dv summed over GQA groups."""
    dq, dk, dv, _, _ = _backward(dout, q, k, v, out, lse, [], [], cu_seqlens_q, cu_seqlens_k, causal, scale,
                                 block_m, block_n)
    return dq, dk, dv


@_without_autocast
def triton_ttt_forward(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TTT branch attention of pass ``P = len(keys)`` (``ttt_attention``'s semantics) as ``(out, lse)``:
    ``keys[0]`` seen causally within the document, ``keys[p >= 1]`` only at the same row."""
    assert len(keys) == len(values) >= 1, (len(keys), len(values))
    return _forward(q, keys[0], values[0], keys[1:], values[1:], cu_seqlens, cu_seqlens, True, scale,
                    block_m, block_n)


@_without_autocast
def triton_ttt_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``(dq, dkeys, dvalues)`` of ``triton_ttt_forward``, one gradient per pass."""
    assert len(keys) == len(values) >= 1, (len(keys), len(values))
    dq, dk, dv, dkb, dvb = _backward(dout, q, keys[0], values[0], out, lse, keys[1:], values[1:], cu_seqlens,
                                     cu_seqlens, True, scale, block_m, block_n)
    return dq, [dk, *dkb], [dv, *dvb]


class TritonAttentionOps:
    """The attention-ops seam (``forward`` / ``backward`` like ``LocalAttentionOps``) on the Triton kernels,
    plus the fused TTT pair that ``ttt_attention`` calls instead of trunk + closed-form branch + merge.

    Also the local block of ring attention: the ring only calls ``forward`` / ``backward`` (and never
    the fused TTT: under context parallel the trunk is the ring and the branch stays closed form).
    ``half_dtype``: what float32 inputs are computed in (a bf16 run's attention sees float32 q/k/v under
    autocast; bf16 tiles take the tensor cores, exact float32 ones do not); None keeps float32.
    """

    supports_context_parallel = True

    def __init__(self, block_m: int | None = None, block_n: int | None = None, half_dtype: torch.dtype | None = None):
        self.blocks = dict(block_m=block_m, block_n=block_n)
        self.half_dtype = half_dtype

    def _in(self, *tensors):
        """float32 tensors in `half_dtype` (when set); everything else unchanged."""
        cast = self.half_dtype is not None
        return [t.to(self.half_dtype) if cast and t.dtype == torch.float32 else t for t in tensors]

    def ttt_ops(self, device: torch.device) -> "TritonAttentionOps":
        """What ``ttt_attention`` fuses trunk and branch with: these kernels."""
        return self

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        out, lse = triton_attn_forward(*self._in(q, k, v), cu_seqlens_q, cu_seqlens_k, causal, scale, **self.blocks)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        grads = triton_attn_backward(*self._in(dout, q, k, v, out), lse, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                     **self.blocks)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))

    def ttt_forward(self, q, keys, values, cu_seqlens, scale=None):
        out, lse = triton_ttt_forward(*self._in(q), self._in(*keys), self._in(*values), cu_seqlens, scale,
                                      **self.blocks)
        return out.to(q.dtype), lse

    def ttt_backward(self, dout, q, keys, values, out, lse, cu_seqlens, scale=None):
        dq, dks, dvs = triton_ttt_backward(*self._in(dout, q), self._in(*keys), self._in(*values), *self._in(out),
                                           lse, cu_seqlens, scale, **self.blocks)
        return (dq.to(q.dtype), [g.to(k.dtype) for g, k in zip(dks, keys)],
                [g.to(v.dtype) for g, v in zip(dvs, values)])

"""Triton kernels of the fused draft loss: lm_head + soft cross-entropy without [T, Vd] logits.

Per token row, with draft logits ``z = h W^T`` (over the draft vocabulary) and the teacher's
restricted logits ``t``: ``ce = lse(z) - sum_j softmax(t)_j z_j`` (= ``-sum_j p_j log_softmax(z)_j``).

- Forward (`soft_ce_forward`): one program per (block of ``BLOCK_T`` rows, vocabulary split)
  walks its vocabulary tiles, computing each ``[BLOCK_T, BLOCK_V]`` logits tile with ``tl.dot``
  over the hidden size (fp32 accumulation) and folding it into online statistics: max and
  sum of exponentials of ``z`` and of ``t``, the teacher-weighted sum of ``z``, and the running
  argmax of ``z``. The vocabulary is split across programs so that a few thousand rows still
  fill the GPU; the per-split statistics (``[splits, T]``) are combined in torch. Nothing of
  size ``T x Vd`` is ever written.
- Backward (`soft_ce_dlogits`): for one chunk of rows, one program per (row block, vocabulary
  tile) recomputes its logits tile the same way and writes ``dz = g (softmax(z) - softmax(t))``
  from the forward's two log-sum-exps; the caller turns ``dz [chunk, Vd]`` into the hidden-state
  and weight gradients with two torch matmuls (cuBLAS beats a hand-written dW reduction).

The teacher is read through a row index (``rows [T]``, int64: draft row i scores against
teacher row ``rows[i]``), so that TTT pass d reads the one teacher tensor at rows ``i + d``
instead of a shifted ``[T, Vd]`` copy per pass; without ``rows`` row i reads teacher row i.

Row offsets are int64 (``T x V`` teacher logits pass 2**31 elements at 64K tokens and a 128K
vocabulary). Dots run at ``input_precision="ieee"`` (fp32 inputs are not truncated to TF32;
bf16 is the fast path). Tested under ``TRITON_INTERPRET=1`` on CPU in fp64 and fp32 (with a
bf16 teacher); the interpreter multiplies bf16 blocks as raw integers, so bf16 hidden states
and weights are checked by the ``gpu``-marked tests only.
"""

import torch
import triton
import triton.language as tl

_STATS = 6  # max z, sum exp(z - max z), max t, sum exp(t - max t), sum exp(t - max t) z, best z
# Launch defaults, checked for spills and shared memory by compiling for sm_90 / sm_80 (tests/triton_compile.py):
# a [64, 128] float32 logits tile and its softmax temporaries spill with 4 warps; float32 slices of 64 hidden
# units (an ieee tl.dot on the FMA units) spill even with 8.
BLOCK_T, BLOCK_V, BLOCK_K = 64, 128, 32
NUM_WARPS = 8


@triton.jit
def _logits_tile(z, H, W, rows, row_ok, cols, col_ok, hidden_size, stride_h, stride_w, BLOCK_K: tl.constexpr):
    """z += h[rows] @ W[cols]^T, walking the hidden size in BLOCK_K slices."""
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        h = tl.load(H + rows[:, None].to(tl.int64) * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + cols[None, :].to(tl.int64) * stride_w + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)
        z = tl.dot(h, w, z, input_precision="ieee")
    return z


@triton.jit
def _soft_ce_fwd(H, W, TEACHER, TEACHER_ROWS, STATS, BEST_ID, n_rows, vocab, hidden_size, split_width,
                 stride_h, stride_w, stride_t,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = STATS.dtype.element_ty
    split, n_splits = tl.program_id(1), tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    teacher_row = tl.load(TEACHER_ROWS + rows, mask=row_ok, other=0) * stride_t
    m_z = tl.full([BLOCK_T], float("-inf"), acc)
    s_z = tl.zeros([BLOCK_T], acc)
    m_t = tl.full([BLOCK_T], float("-inf"), acc)
    s_t = tl.zeros([BLOCK_T], acc)
    zt = tl.zeros([BLOCK_T], acc)
    best = tl.full([BLOCK_T], float("-inf"), acc)
    best_id = tl.zeros([BLOCK_T], tl.int64)
    v_start = split * split_width
    v_end = tl.minimum(v_start + split_width, vocab)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _logits_tile(tl.zeros([BLOCK_T, BLOCK_V], acc), H, W, rows, row_ok, cols, col_ok, hidden_size,
                         stride_h, stride_w, BLOCK_K)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        # padding rows read teacher 0 (not -inf), so every row's statistics stay finite
        t = tl.load(TEACHER + teacher_row[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(acc)
        t = tl.where(col_ok[None, :], t, float("-inf"))

        m_new = tl.maximum(m_z, tl.max(z, 1))
        s_z = s_z * tl.exp(m_z - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m_z = m_new

        mt_new = tl.maximum(m_t, tl.max(t, 1))
        rescale = tl.exp(m_t - mt_new)
        p = tl.exp(t - mt_new[:, None])
        s_t = s_t * rescale + tl.sum(p, 1)
        zt = zt * rescale + tl.sum(p * tl.where(col_ok[None, :], z, 0.0), 1)
        m_t = mt_new

        tile_best, tile_arg = tl.max(z, 1, return_indices=True, return_indices_tie_break_left=True)
        better = tile_best > best  # strict: ties keep the earlier tile, like torch.argmax
        best_id = tl.where(better, v0 + tile_arg.to(tl.int64), best_id)
        best = tl.where(better, tile_best, best)

    stat = STATS + split * n_rows + rows
    step = n_splits * n_rows
    tl.store(stat, m_z, mask=row_ok)
    tl.store(stat + step, s_z, mask=row_ok)
    tl.store(stat + 2 * step, m_t, mask=row_ok)
    tl.store(stat + 3 * step, s_t, mask=row_ok)
    tl.store(stat + 4 * step, zt, mask=row_ok)
    tl.store(stat + 5 * step, best, mask=row_ok)
    tl.store(BEST_ID + split * n_rows + rows, best_id, mask=row_ok)


@triton.jit
def _soft_ce_bwd(H, W, TEACHER, TEACHER_ROWS, GRAD, LSE_Z, LSE_T, DZ, n_rows, vocab, hidden_size,
                 stride_h, stride_w, stride_t, stride_dz,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = GRAD.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    col_ok = cols < vocab
    tile_ok = row_ok[:, None] & col_ok[None, :]
    z = _logits_tile(tl.zeros([BLOCK_T, BLOCK_V], acc), H, W, rows, row_ok, cols, col_ok, hidden_size,
                     stride_h, stride_w, BLOCK_K)
    teacher_row = tl.load(TEACHER_ROWS + rows, mask=row_ok, other=0) * stride_t
    t = tl.load(TEACHER + teacher_row[:, None] + cols[None, :], mask=tile_ok, other=0.0).to(acc)
    g = tl.load(GRAD + rows, mask=row_ok, other=0.0)
    lse_z = tl.load(LSE_Z + rows, mask=row_ok, other=0.0)
    lse_t = tl.load(LSE_T + rows, mask=row_ok, other=0.0)
    dz = g[:, None] * (tl.exp(z - lse_z[:, None]) - tl.exp(t - lse_t[:, None]))
    tl.store(DZ + rows[:, None].to(tl.int64) * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=tile_ok)


def _teacher_rows(hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor,
                  rows: torch.Tensor | None) -> torch.Tensor:
    """Checks the shapes; the teacher row of each hidden row (`rows`, or the identity) as contiguous int64."""
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1], (hidden.shape, weight.shape)
    assert teacher.dim() == 2 and teacher.shape[1] == weight.shape[0], (teacher.shape, weight.shape)
    assert hidden.dtype == weight.dtype, (hidden.dtype, weight.dtype)
    assert hidden.stride(-1) == weight.stride(-1) == teacher.stride(-1) == 1, "the last dims must be contiguous"
    if rows is None:
        assert teacher.shape[0] == hidden.shape[0], (teacher.shape, hidden.shape)
        return torch.arange(hidden.shape[0], device=hidden.device)
    assert rows.shape == hidden.shape[:1] and rows.dtype == torch.int64, (rows.shape, rows.dtype)
    return rows.contiguous()


def _default_splits(device: torch.device, row_blocks: int, vocab_tiles: int) -> int:
    """Enough vocabulary splits for ~2 programs per SM (1 under the CPU interpreter)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(vocab_tiles, triton.cdiv(2 * sms, row_blocks)))


def _combine_splits(stats: torch.Tensor, best_id: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(ce, top1, lse_z, lse_t) from the per-split statistics `[6, splits, T]` (log-sum-exp merges)."""
    m_z, s_z, m_t, s_t, zt, best = stats.unbind(0)
    top_z, top_t = m_z.amax(0), m_t.amax(0)
    lse_z = top_z + (s_z * torch.exp(m_z - top_z)).sum(0).log()
    scale_t = torch.exp(m_t - top_t)
    total_t = (s_t * scale_t).sum(0)
    ce = lse_z - (zt * scale_t).sum(0) / total_t
    top1 = best_id.gather(0, best.argmax(0, keepdim=True)).squeeze(0)  # argmax: the first split on ties
    return ce, top1, lse_z, top_t + total_t.log()


def soft_ce_forward(hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, *,
                    rows: torch.Tensor | None = None, splits: int | None = None, block_t: int = BLOCK_T,
                    block_v: int = BLOCK_V, block_k: int = BLOCK_K) -> tuple[torch.Tensor, ...]:
    """Per row: soft CE `[T]`, the draft's argmax id `[T]`, and lse of the draft and teacher logits `[T]`.

    `hidden [T, H]` and `weight [Vd, H]` (same dtype), `teacher [N, Vd]` (any float dtype; read
    tile by tile and upcast there) at rows `rows` (int64 `[T]`, each in `[0, N)`; default: row i,
    with N = T). Statistics are fp32 (fp64 for an fp64 `hidden`).
    """
    teacher_rows = _teacher_rows(hidden, weight, teacher, rows)
    (n_rows, hidden_size), vocab = hidden.shape, weight.shape[0]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # tl.dot's accumulator
    row_blocks, vocab_tiles = triton.cdiv(n_rows, block_t), triton.cdiv(vocab, block_v)
    splits = splits or _default_splits(hidden.device, row_blocks, vocab_tiles)
    split_width = triton.cdiv(vocab_tiles, splits) * block_v
    splits = triton.cdiv(vocab, split_width)  # none empty
    stats = torch.empty(_STATS, splits, n_rows, device=hidden.device, dtype=acc)
    best_id = torch.empty(splits, n_rows, device=hidden.device, dtype=torch.int64)
    if n_rows:
        _soft_ce_fwd[(row_blocks, splits)](
            hidden, weight, teacher, teacher_rows, stats, best_id, n_rows, vocab, hidden_size, split_width,
            hidden.stride(0), weight.stride(0), teacher.stride(0),
            BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=NUM_WARPS)
    return _combine_splits(stats, best_id)


def soft_ce_dlogits(hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, grad: torch.Tensor,
                    lse_z: torch.Tensor, lse_t: torch.Tensor, *, rows: torch.Tensor | None = None,
                    block_t: int = BLOCK_T, block_v: int = BLOCK_V, block_k: int = BLOCK_K) -> torch.Tensor:
    """`d(sum grad * ce)/dz [T, Vd]` in the weight's dtype, the logits recomputed tile by tile.

    `grad [T]` (zero on rows that do not count) and the forward's `lse_z`, `lse_t`, all in the
    statistics dtype; `teacher` and `rows` as in `soft_ce_forward`. Called on one chunk of rows
    at a time (views of the full tensors; the whole teacher with the chunk's `rows`).
    """
    teacher_rows = _teacher_rows(hidden, weight, teacher, rows)
    (n_rows, hidden_size), vocab = hidden.shape, weight.shape[0]
    dz = torch.empty(n_rows, vocab, device=hidden.device, dtype=weight.dtype)
    if n_rows:
        grid = (triton.cdiv(n_rows, block_t), triton.cdiv(vocab, block_v))
        _soft_ce_bwd[grid](
            hidden, weight, teacher, teacher_rows, grad.contiguous(), lse_z.contiguous(), lse_t.contiguous(), dz,
            n_rows, vocab, hidden_size, hidden.stride(0), weight.stride(0), teacher.stride(0), dz.stride(0),
            BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=NUM_WARPS)
    return dz

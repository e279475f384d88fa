"""Triton LSE merge of two partial attention results, forward and backward (GPU fast path).

Same contract as ``spectrain.ops.lse_merge.merge_attn`` with two tensors: ``(out, lse)`` and
``(block_out, block_lse)`` over disjoint key sets become the result over their union, in fp32
(fp64 if an input is fp64), and rows with ``lse = -inf`` on either side take the other side.
The torch version is a chain of ~10 elementwise ops (each a kernel launch and a round trip
through memory per ring step); here one program handles ``BLOCK_R`` (token, head) rows at once.
Both sides' weights come from ``w_a = sigmoid(lse_a - lse_b)``, ``w_b = sigmoid(lse_b - lse_a)``,
evaluated through ``exp(-|diff|)`` so that nothing overflows and no NaN appears.
Tested under ``TRITON_INTERPRET=1`` on CPU.
"""

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_weights(l_a, l_b):
    """(w_a, w_b, lse, both_present) of two lse rows; the empty sides get weight 0 or 1."""
    empty_a = l_a == float("-inf")
    empty_b = l_b == float("-inf")
    present = ~(empty_a | empty_b)
    diff = tl.where(present, l_a, 0.0) - tl.where(present, l_b, 0.0)  # finite everywhere
    e = tl.exp(-tl.abs(diff))
    sig_pos = 1.0 / (1.0 + e)  # sigmoid(|diff|)
    sig_neg = e / (1.0 + e)  # sigmoid(-|diff|)
    w_a = tl.where(diff >= 0, sig_pos, sig_neg)
    w_b = tl.where(diff >= 0, sig_neg, sig_pos)
    merged_lse = tl.maximum(l_a, l_b) + tl.log(1.0 + e)
    # empty b: keep a; empty a (b present): take b
    w_a = tl.where(empty_b, 1.0, tl.where(empty_a, 0.0, w_a))
    w_b = tl.where(empty_b, 0.0, tl.where(empty_a, 1.0, w_b))
    lse = tl.where(empty_b, l_a, tl.where(empty_a, l_b, merged_lse))
    return w_a, w_b, lse, present


@triton.jit
def _load_block(O_A, L_A, O_B, L_B, ACC_LIKE, n_rows, head_dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows of both sides, in the dtype of `ACC_LIKE`, with their offsets and masks."""
    acc = ACC_LIKE.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    tile_ok = row_ok[:, None] & (cols < head_dim)[None, :]
    tile = rows[:, None] * head_dim + cols[None, :]
    l_a = tl.load(L_A + rows, mask=row_ok, other=0.0).to(acc)
    l_b = tl.load(L_B + rows, mask=row_ok, other=0.0).to(acc)
    o_a = tl.load(O_A + tile, mask=tile_ok, other=0.0).to(acc)
    o_b = tl.load(O_B + tile, mask=tile_ok, other=0.0).to(acc)
    return rows, row_ok, tile, tile_ok, l_a, l_b, o_a, o_b


@triton.jit
def _merge_fwd(O_A, L_A, O_B, L_B, O, L, n_rows, head_dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, row_ok, tile, tile_ok, l_a, l_b, o_a, o_b = _load_block(O_A, L_A, O_B, L_B, O, n_rows, head_dim,
                                                                  BLOCK_R, BLOCK_D)
    _, w_b, lse, _ = _merge_weights(l_a, l_b)
    # out - w_b (out - out_b), as the torch merge writes it (exact for w_b = 0 or 1)
    out = o_a - w_b[:, None] * (o_a - o_b)
    tl.store(O + tile, out, mask=tile_ok)
    tl.store(L + rows, lse, mask=row_ok)


@triton.jit
def _merge_bwd(O_A, L_A, O_B, L_B, G_O, G_L, DO_A, DL_A, DO_B, DL_B, n_rows, head_dim,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = w_a o_a + w_b o_b, lse = logaddexp(l_a, l_b); dw_a/dl_a = -w_a w_b = -dw_b/dl_a."""
    rows, row_ok, tile, tile_ok, l_a, l_b, o_a, o_b = _load_block(O_A, L_A, O_B, L_B, G_O, n_rows, head_dim,
                                                                  BLOCK_R, BLOCK_D)
    g_o = tl.load(G_O + tile, mask=tile_ok, other=0.0)
    g_l = tl.load(G_L + rows, mask=row_ok, other=0.0)
    w_a, w_b, _, present = _merge_weights(l_a, l_b)
    cross = tl.where(present, w_a * w_b, 0.0) * tl.sum(g_o * (o_b - o_a), 1)
    tl.store(DO_A + tile, (w_a[:, None] * g_o).to(DO_A.dtype.element_ty), mask=tile_ok)
    tl.store(DO_B + tile, (w_b[:, None] * g_o).to(DO_B.dtype.element_ty), mask=tile_ok)
    tl.store(DL_A + rows, (w_a * g_l - cross).to(DL_A.dtype.element_ty), mask=row_ok)
    tl.store(DL_B + rows, (w_b * g_l + cross).to(DL_B.dtype.element_ty), mask=row_ok)


def _launch(kernel, n_rows: int, head_dim: int, *args, block_r: int = 32) -> None:
    grid = (triton.cdiv(n_rows, block_r),)
    kernel[grid](*args, n_rows, head_dim, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(head_dim))


class _TritonMerge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, lse, block_out, block_lse):
        # fp32, or fp64 if an input is: the merge never runs in 16 bits
        acc = functools.reduce(torch.promote_types, (t.dtype for t in (out, lse, block_out, block_lse)),
                               torch.float32)
        inputs = tuple(t.contiguous() for t in (out, lse, block_out, block_lse))
        t, h, d = out.shape
        new_out = torch.empty(t, h, d, device=out.device, dtype=acc)
        new_lse = torch.empty(t, h, device=out.device, dtype=acc)
        if new_lse.numel():
            _launch(_merge_fwd, t * h, d, *inputs, new_out, new_lse)
        ctx.save_for_backward(*inputs)
        ctx.acc = acc
        return new_out, new_lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        out, lse, block_out, block_lse = ctx.saved_tensors
        grad_out = (torch.zeros(out.shape, device=out.device, dtype=ctx.acc) if grad_out is None
                    else grad_out.to(ctx.acc).contiguous())
        grad_lse = (torch.zeros(lse.shape, device=lse.device, dtype=ctx.acc) if grad_lse is None
                    else grad_lse.to(ctx.acc).contiguous())
        grads = tuple(torch.empty_like(x) for x in (out, lse, block_out, block_lse))
        if lse.numel():
            _launch(_merge_bwd, lse.numel(), out.shape[-1], out, lse, block_out, block_lse, grad_out, grad_lse,
                    *grads)
        return grads


def triton_merge_attn(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_attn(out, lse, block_out, block_lse)`` in one kernel each way (``out [T, H, D]``, ``lse [T, H]``).

    Returns new fp32 tensors (fp64 if an input is fp64); differentiable in all four inputs.
    """
    assert out.shape == block_out.shape and out.dim() == 3, (out.shape, block_out.shape)
    assert lse.shape == block_lse.shape == out.shape[:2], (lse.shape, block_lse.shape)
    return _TritonMerge.apply(out, lse, block_out, block_lse)

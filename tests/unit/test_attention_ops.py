"""Packed varlen attention ops and the LSE merge against a dense float64 reference.

Tolerances: float64 results must match the reference to atol = rtol = 1e-10 (the blockwise
online softmax only reorders sums); float32 to 1e-5; bf16 to 3e-2. The Triton kernels are
tested in test_triton_attention.py.
"""

import pytest
import torch

from spectrain.ops.attention import (
    LocalAttentionOps,
    attn_backward,
    attn_forward,
    varlen_attention,
    varlen_attention_with_lse,
)
from spectrain.ops.lse_merge import merge_attn
from tests.helpers import cu_of, dense_attention, dense_mask

TOL64 = dict(atol=1e-10, rtol=1e-10)
LENGTHS = [1, 7, 33, 130, 5]


def make_qkv(n_q, n_k, hq, hkv, dim=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, hq, dim, generator=g, dtype=dtype)
    k = torch.randn(n_k, hkv, dim, generator=g, dtype=dtype)
    v = torch.randn(n_k, hkv, dim, generator=g, dtype=dtype)
    return q, k, v


def reference_grads(q, k, v, mask, dout, scale=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = dense_attention(*leaves, mask, scale)
    return torch.autograd.grad(out, leaves, dout)


pytestmark = pytest.mark.usefixtures("one_thread")


HEADS = pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)], ids=["gqa", "mha"])
BLOCKS = pytest.mark.parametrize(
    "block_q,block_k", [(16, 8), (128, 1024)], ids=["small", "default"]
)


@HEADS
@BLOCKS
def test_causal_matches_dense(hq, hkv, block_q, block_k):
    cu = cu_of(LENGTHS)
    q, k, v = make_qkv(sum(LENGTHS), sum(LENGTHS), hq, hkv)
    dout = torch.randn_like(q)
    mask = dense_mask(LENGTHS, LENGTHS, causal=True)
    blocks = dict(block_q=block_q, block_k=block_k)

    out, lse = attn_forward(q, k, v, cu, cu, causal=True, **blocks)
    ref_out, ref_lse = dense_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref_out, **TOL64)
    torch.testing.assert_close(lse, ref_lse, **TOL64)

    grads = attn_backward(dout, q, k, v, out, lse, cu, cu, causal=True, **blocks)
    for got, ref in zip(grads, reference_grads(q, k, v, mask, dout)):
        torch.testing.assert_close(got, ref, **TOL64)


@HEADS
@BLOCKS
def test_non_causal_different_q_k_lengths(hq, hkv, block_q, block_k):
    # An empty key document (rows must give out 0, lse -inf) and an empty query document.
    lens_q, lens_k = [1, 7, 33, 0, 130, 5], [3, 0, 50, 4, 20, 9]
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    q, k, v = make_qkv(sum(lens_q), sum(lens_k), hq, hkv, seed=1)
    dout = torch.randn_like(q)
    mask = dense_mask(lens_q, lens_k, causal=False)
    scale = 0.3
    blocks = dict(block_q=block_q, block_k=block_k)

    out, lse = attn_forward(q, k, v, cu_q, cu_k, causal=False, scale=scale, **blocks)
    ref_out, ref_lse = dense_attention(q, k, v, mask, scale)
    torch.testing.assert_close(out, ref_out, **TOL64)
    torch.testing.assert_close(lse, ref_lse, **TOL64)
    assert torch.all(lse[1:8] == float("-inf")) and torch.all(out[1:8] == 0)

    grads = attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, False, scale, **blocks)
    for got, ref in zip(grads, reference_grads(q, k, v, mask, dout, scale)):
        torch.testing.assert_close(got, ref, **TOL64)


def test_causal_with_empty_documents():
    lengths = [0, 5, 0, 12, 0]
    cu = cu_of(lengths)
    q, k, v = make_qkv(17, 17, 2, 1, seed=2)
    out, lse = attn_forward(q, k, v, cu, cu, causal=True, block_q=4, block_k=4)
    ref_out, ref_lse = dense_attention(q, k, v, dense_mask(lengths, lengths, True))
    torch.testing.assert_close(out, ref_out, **TOL64)
    torch.testing.assert_close(lse, ref_lse, **TOL64)


def test_block_size_does_not_change_results():
    lengths = [300, 3, 150]
    cu = cu_of(lengths)
    q, k, v = make_qkv(453, 453, 4, 2, dim=8, seed=3)
    dout = torch.randn_like(q)
    results = []
    for block_q, block_k in [(512, 512), (128, 1024), (37, 53)]:
        ops = LocalAttentionOps(block_q, block_k)
        out, lse = ops.forward(q, k, v, cu, cu, True)
        results.append((out, lse, *ops.backward(dout, q, k, v, out, lse, cu, cu, True)))
    for other in results[1:]:
        for got, ref in zip(other, results[0]):
            torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


def test_backward_with_joint_statistics():
    """Two key halves attended separately, merged, then each backward given the joint
    (out, lse): the part gradients sum to the full-attention gradients (the ring case)."""
    lens_q, lens_k, half = [9, 20, 4], [12, 6, 10], [6, 3, 5]
    cu_q = cu_of(lens_q)
    q, k, v = make_qkv(sum(lens_q), sum(lens_k), 4, 2, seed=4)
    dout = torch.randn_like(q)
    # Every document's keys split into its first and its second half.
    starts = cu_of(lens_k)[:-1].tolist()
    idx = [
        torch.cat([torch.arange(s + off * n, s + (off + 1) * n) for s, n in zip(starts, half)])
        for off in (0, 1)
    ]
    parts = [(k[i], v[i], cu_of(half)) for i in idx]

    out = lse = None
    for kp, vp, cu_kp in parts:
        out, lse = merge_attn(out, lse, *attn_forward(q, kp, vp, cu_q, cu_kp, causal=False))
    full_out, full_lse = attn_forward(q, k, v, cu_q, cu_of(lens_k), causal=False)
    torch.testing.assert_close(out, full_out, **TOL64)
    torch.testing.assert_close(lse, full_lse, **TOL64)

    ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, dense_mask(lens_q, lens_k, False), dout)
    dq = torch.zeros_like(q)
    for (kp, vp, cu_kp), i in zip(parts, idx):
        dq_p, dk_p, dv_p = attn_backward(dout, q, kp, vp, out, lse, cu_q, cu_kp, False)
        dq += dq_p
        torch.testing.assert_close(dk_p, ref_dk[i], **TOL64)
        torch.testing.assert_close(dv_p, ref_dv[i], **TOL64)
    torch.testing.assert_close(dq, ref_dq, **TOL64)


@HEADS
def test_varlen_attention_autograd(hq, hkv):
    cu = cu_of(LENGTHS)
    q, k, v = (t.requires_grad_() for t in make_qkv(sum(LENGTHS), sum(LENGTHS), hq, hkv, seed=5))
    out, lse = varlen_attention_with_lse(q, k, v, cu, causal=True, ops=LocalAttentionOps(32, 16))
    assert not lse.requires_grad
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = dense_mask(LENGTHS, LENGTHS, True)
    torch.testing.assert_close(out, dense_attention(q, k, v, mask)[0], **TOL64)
    for got, ref in zip(grads, reference_grads(q, k, v, mask, dout)):
        torch.testing.assert_close(got, ref, **TOL64)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attention_gradcheck(causal):
    cu = cu_of([2, 4])
    q, k, v = (t.requires_grad_() for t in make_qkv(6, 6, 2, 1, dim=3, seed=6))
    ops = LocalAttentionOps(block_q=4, block_k=2)
    assert torch.autograd.gradcheck(
        lambda q, k, v: varlen_attention(q, k, v, cu, causal=causal, ops=ops), (q, k, v)
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_inputs(dtype, tol):
    cu = cu_of(LENGTHS)
    q64, k64, v64 = make_qkv(sum(LENGTHS), sum(LENGTHS), 4, 2, seed=7)
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    out, lse = attn_forward(q, k, v, cu, cu, causal=True, block_q=32, block_k=16)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = dense_attention(
        *(t.double() for t in (q, k, v)), dense_mask(LENGTHS, LENGTHS, True)
    )
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
    dq, dk, dv = attn_backward(torch.ones_like(q), q, k, v, out, lse, cu, cu, True)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)


def test_merge_halves_equals_full_attention():
    q, k, v = make_qkv(5, 12, 2, 2, seed=8)
    everything = torch.ones(5, 12, dtype=torch.bool)
    first, second = dense_attention(q, k[:7], v[:7], everything[:, :7]), dense_attention(
        q, k[7:], v[7:], everything[:, 7:]
    )
    out, lse = merge_attn(*merge_attn(None, None, *first), *second)
    ref_out, ref_lse = dense_attention(q, k, v, everything)
    torch.testing.assert_close(out, ref_out, **TOL64)
    torch.testing.assert_close(lse, ref_lse, **TOL64)


def test_merge_handles_empty_rows_and_large_gaps():
    out_a = torch.randn(4, 1, 3, dtype=torch.float64, requires_grad=True)
    out_b = torch.randn(4, 1, 3, dtype=torch.float64, requires_grad=True)
    inf = float("-inf")
    lse_a = torch.tensor([[inf], [1.0], [inf], [1000.0]], dtype=torch.float64, requires_grad=True)
    lse_b = torch.tensor([[2.0], [inf], [inf], [-1000.0]], dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        out_a[0] = 0  # contract: rows with lse = -inf have out = 0
        out_a[2] = 0
        out_b[1:3] = 0

    out, lse = merge_attn(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out[0], out_b[0])
    torch.testing.assert_close(out[1], out_a[1])
    torch.testing.assert_close(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out[3], out_a[3])
    torch.testing.assert_close(lse, torch.tensor([[2.0], [1.0], [inf], [1000.0]]).double())

    (out.sum() + lse[lse.isfinite()].sum()).backward()
    for t in (out_a, out_b, lse_a, lse_b):
        assert torch.isfinite(t.grad).all()


def test_merge_accumulates_in_float32():
    out_b = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    lse_b = torch.randn(3, 2)
    out, lse = merge_attn(None, None, out_b, lse_b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    out, lse = merge_attn(out, lse, out_b, lse_b)
    torch.testing.assert_close(out, out_b.float())
    torch.testing.assert_close(lse, lse_b + torch.log(torch.tensor(2.0)))

"""Triton attention kernels (plain varlen and fused TTT) against dense float64 references.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) with tiny sizes and 16-row blocks, so
documents span several blocks. Tolerances vs float64: float32 inputs 2e-5 (``tl.dot`` with
``input_precision="ieee"``); bf16 inputs: out 3e-2, gradients 6e-2 elementwise on O(1) data. The
``gpu``-marked tests compile the same kernels on CUDA at T = 4096, D = 128, bf16, checked by relative
error ``|got - ref| / |ref| <= 1.5e-2`` (Frobenius norms; bf16 has an 8-bit mantissa) and float32 to 1e-4.
"""

import pytest
import torch

from spectrain.kernels.attention_triton import (
    TritonAttentionOps,
    triton_attn_backward,
    triton_attn_forward,
    triton_ttt_backward,
    triton_ttt_forward,
)
from spectrain.ops.attention import varlen_attention
from spectrain.ops.lse_merge import merge_attn
from spectrain.ops.ttt_attention import ttt_attention
from tests.helpers import cu_of, dense_attention, dense_mask, dense_ttt, staircase_mask

TOL32 = dict(atol=2e-5, rtol=2e-5)
TOL16_OUT = dict(atol=3e-2, rtol=3e-2)
TOL16_GRAD = dict(atol=6e-2, rtol=6e-2)
GPU_REL_BF16 = 1.5e-2
SMALL = dict(block_m=16, block_n=16)

pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def dense_grads(fn, inputs, dout):
    """Gradients of the float64 reference ``fn`` w.r.t. every input."""
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, dout.double())


def assert_close(got, want, tol):
    """``tol``: assert_close kwargs, or a float bounding the relative Frobenius error."""
    if isinstance(tol, dict):
        torch.testing.assert_close(got.double(), want, **tol)
    else:
        err = (got.double() - want).norm() / want.norm().clamp_min(1e-30)
        assert err <= tol, f"relative error {err:.2e} > {tol:.1e}"


def check_attention(lens_q, lens_k, causal, hq, hkv, dim, dtype, device, out_tol, grad_tol, blocks, scale=None):
    """Forward (out, lse) and all gradients of the plain kernels against the dense reference."""
    cu_q, cu_k = cu_of(lens_q).to(device), cu_of(lens_k).to(device)
    q = randn(sum(lens_q), hq, dim, dtype=dtype, device=device, seed=0)
    k, v = (randn(sum(lens_k), hkv, dim, dtype=dtype, device=device, seed=s) for s in (1, 2))
    dout = randn(*q.shape, dtype=dtype, device=device, seed=3)
    mask = dense_mask(lens_q, lens_k, causal).to(device)

    out, lse = triton_attn_forward(q, k, v, cu_q, cu_k, causal, scale, **blocks)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = dense_attention(q.double(), k.double(), v.double(), mask, scale)
    assert_close(out, ref_out, out_tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4 if dtype == torch.float32 else 5e-3, rtol=0)

    grads = triton_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, **blocks)
    _, ref_grads = dense_grads(lambda *x: dense_attention(*x, mask, scale)[0], (q, k, v), dout)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == dtype
        assert_close(got, want, grad_tol)
    return out, lse


def check_ttt(lengths, n_pass, hq, hkv, dim, dtype, device, out_tol, grad_tol, blocks):
    """Fused TTT forward and the gradients of q and every pass's keys / values against the staircase."""
    cu = cu_of(lengths).to(device)
    t = sum(lengths)
    q = randn(t, hq, dim, dtype=dtype, device=device, seed=n_pass)
    keys = [randn(t, hkv, dim, dtype=dtype, device=device, seed=10 + p) for p in range(n_pass)]
    values = [randn(t, hkv, dim, dtype=dtype, device=device, seed=20 + p) for p in range(n_pass)]
    dout = randn(t, hq, dim, dtype=dtype, device=device, seed=30)
    mask = staircase_mask(lengths, n_pass).to(device)

    out, lse = triton_ttt_forward(q, keys, values, cu, **blocks)
    reference = lambda q, *kv: dense_ttt(q, kv[:n_pass], kv[n_pass:], mask)  # noqa: E731
    ref_out, ref_grads = dense_grads(reference, (q, *keys, *values), dout)
    assert_close(out, ref_out, out_tol)

    dq, dkeys, dvalues = triton_ttt_backward(dout, q, keys, values, out, lse, cu, **blocks)
    assert len(dkeys) == len(dvalues) == n_pass
    for got, want in zip((dq, *dkeys, *dvalues), ref_grads):
        assert got.dtype == dtype
        assert_close(got, want, grad_tol)


# Length-1 documents, documents spanning several 16-row blocks; non-causal: q / k lengths differ, a document
# without keys (rows: out 0, lse -inf) and one without queries.
CAUSAL_LENS = [1, 7, 33, 1, 20]
LENS_Q, LENS_K = [1, 7, 33, 0, 20, 5], [3, 0, 40, 4, 17, 9]


@pytest.mark.parametrize(
    "causal,hq,hkv,block_m,block_n",
    [(True, 4, 2, 16, 32), (True, 2, 2, 32, 16), (False, 4, 2, 16, 32), (False, 2, 2, 32, 16)],
    ids=["causal-gqa-16x32", "causal-mha-32x16", "cross-gqa-16x32", "cross-mha-32x16"],
)
def test_attention_matches_dense(causal, hq, hkv, block_m, block_n):
    lens_q, lens_k = (CAUSAL_LENS, CAUSAL_LENS) if causal else (LENS_Q, LENS_K)
    out, lse = check_attention(lens_q, lens_k, causal, hq, hkv, 24, torch.float32, "cpu", TOL32, TOL32,
                               dict(block_m=block_m, block_n=block_n), scale=0.3)
    if not causal:  # document 1 has queries 1..7 and no keys
        assert torch.all(lse[1:8] == float("-inf")) and torch.all(out[1:8] == 0)


def test_backward_with_joint_statistics():
    """Each document's keys in two halves, forwards merged, each backward given the joint (out, lse):
    the part gradients sum to the dense gradients (what ring attention does with its steps)."""
    lens_q, lens_k, half = [9, 20, 4], [12, 6, 10], [6, 3, 5]
    cu_q, cu_half = cu_of(lens_q), cu_of(half)
    q = randn(sum(lens_q), 2, 16, dtype=torch.float32, device="cpu", seed=0)
    k, v = (randn(sum(lens_k), 1, 16, dtype=torch.float32, device="cpu", seed=s) for s in (1, 2))
    dout = randn(*q.shape, dtype=torch.float32, device="cpu", seed=3)
    starts = cu_of(lens_k)[:-1].tolist()
    idx = [torch.cat([torch.arange(s + off * n, s + (off + 1) * n) for s, n in zip(starts, half)]) for off in (0, 1)]

    out = lse = None
    for i in idx:
        out, lse = merge_attn(out, lse, *triton_attn_forward(q, k[i], v[i], cu_q, cu_half, False, **SMALL))
    mask = dense_mask(lens_q, lens_k, False)
    ref_out, (ref_dq, ref_dk, ref_dv) = dense_grads(lambda *x: dense_attention(*x, mask)[0], (q, k, v), dout)
    torch.testing.assert_close(out.double(), ref_out, **TOL32)

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i in idx:
        dq_p, dk[i], dv[i] = triton_attn_backward(dout, q, k[i], v[i], out, lse, cu_q, cu_half, False, **SMALL)
        dq += dq_p
    for got, want in zip((dq, dk, dv), (ref_dq, ref_dk, ref_dv)):
        torch.testing.assert_close(got.double(), want, **TOL32)


@pytest.mark.parametrize("n_pass", [1, 2, 3, 4, 5])
def test_ttt_matches_dense_staircase(n_pass):
    check_ttt([1, 5, 20], n_pass, 2, 1, 16, torch.float32, "cpu", TOL32, TOL32, SMALL)


def test_bf16_inputs():
    lens = [1, 7, 20]
    check_attention(lens, lens, True, 2, 1, 16, torch.bfloat16, "cpu", TOL16_OUT, TOL16_GRAD, SMALL)
    check_ttt(lens, 3, 2, 1, 16, torch.bfloat16, "cpu", TOL16_OUT, TOL16_GRAD, SMALL)


class RecordingTritonOps(TritonAttentionOps):
    """Records which entry points ``ttt_attention`` / ``varlen_attention`` call."""

    def __init__(self):
        super().__init__(**SMALL)
        self.calls = []

    def forward(self, *args, **kwargs):
        self.calls.append("forward")
        return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls.append("backward")
        return super().backward(*args, **kwargs)

    def ttt_forward(self, *args, **kwargs):
        self.calls.append("ttt_forward")
        return super().ttt_forward(*args, **kwargs)

    def ttt_backward(self, *args, **kwargs):
        self.calls.append("ttt_backward")
        return super().ttt_backward(*args, **kwargs)


def test_ops_through_autograd():
    """TritonAttentionOps behind the seam: varlen_attention and ttt_attention (fused path) with autograd."""
    lengths, n_pass = [3, 18], 3
    cu, t = cu_of(lengths), sum(lengths)
    q = randn(t, 2, 16, dtype=torch.float32, device="cpu", seed=0)
    kv = [randn(t, 1, 16, dtype=torch.float32, device="cpu", seed=1 + i) for i in range(2 * n_pass)]
    dout = randn(t, 2, 16, dtype=torch.float32, device="cpu", seed=9)

    ops = RecordingTritonOps()
    leaves = [x.clone().requires_grad_() for x in (q, *kv)]
    out = varlen_attention(leaves[0], leaves[1], leaves[2], cu, causal=True, ops=ops)
    mask = dense_mask(lengths, lengths, True)
    ref_out, ref_grads = dense_grads(lambda *x: dense_attention(*x, mask)[0], (q, kv[0], kv[1]), dout)
    torch.testing.assert_close(out.double(), ref_out, **TOL32)
    for got, want in zip(torch.autograd.grad(out, leaves[:3], dout), ref_grads):
        torch.testing.assert_close(got.double(), want, **TOL32)
    assert ops.calls == ["forward", "backward"]

    ops.calls.clear()
    out = ttt_attention(leaves[0], leaves[1 : 1 + n_pass], leaves[1 + n_pass :], cu, ops=ops)
    mask = staircase_mask(lengths, n_pass)
    reference = lambda q, *kv: dense_ttt(q, kv[:n_pass], kv[n_pass:], mask)  # noqa: E731
    ref_out, ref_grads = dense_grads(reference, (q, *kv), dout)
    torch.testing.assert_close(out.double(), ref_out, **TOL32)
    for got, want in zip(torch.autograd.grad(out, leaves, dout), ref_grads):
        torch.testing.assert_close(got.double(), want, **TOL32)
    assert ops.calls == ["ttt_forward", "ttt_backward"]


# Compiled on CUDA at realistic sizes (scripts/gpu_check.sh); the float64 references run on the same GPU.
GPU_LENS = [1, 700, 2900, 64, 431]  # T = 4096
GPU_BLOCKS = dict(block_m=64, block_n=64)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "cross"])
def test_gpu_attention_bf16(causal):
    lens_k = GPU_LENS if causal else [5, 0, 3000, 64, 1027]
    check_attention(GPU_LENS, lens_k, causal, 8, 2, 128, torch.bfloat16, "cuda", GPU_REL_BF16, GPU_REL_BF16,
                    GPU_BLOCKS)


@pytest.mark.gpu
def test_gpu_attention_float32_is_ieee():
    """float32 inputs must not go through TF32: the kernels ask tl.dot for ieee precision."""
    lens = [1, 300, 700, 23]
    check_attention(lens, lens, True, 4, 2, 96, torch.float32, "cuda", dict(atol=1e-4, rtol=1e-4),
                    dict(atol=1e-4, rtol=1e-4), {})  # the wrappers' float32 tiles (16 x 16: no spills)


@pytest.mark.gpu
@pytest.mark.parametrize("n_pass", [1, 3, 5])
def test_gpu_ttt_bf16(n_pass):
    check_ttt(GPU_LENS, n_pass, 8, 2, 128, torch.bfloat16, "cuda", GPU_REL_BF16, GPU_REL_BF16, GPU_BLOCKS)

"""TTT branch attention against a dense float64 reference with the explicit staircase mask.

Tolerances: float64 atol = rtol = 1e-10; bf16 inputs 3e-2.
"""

import pytest
import torch

from spectrain.ops.attention import LocalAttentionOps, varlen_attention
from spectrain.ops.ttt_attention import ttt_attention
from tests.helpers import cu_of, dense_ttt, staircase_mask

TOL64 = dict(atol=1e-10, rtol=1e-10)
LENGTHS = [1, 7, 33, 130, 5]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(t, n_pass, hq, hkv, dim=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, dim, generator=g, dtype=dtype)
    keys = [torch.randn(t, hkv, dim, generator=g, dtype=dtype) for _ in range(n_pass)]
    values = [torch.randn(t, hkv, dim, generator=g, dtype=dtype) for _ in range(n_pass)]
    return q, keys, values


def leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("n_pass", [1, 2, 3, 4])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_matches_dense_staircase(n_pass, hq, hkv):
    cu = cu_of(LENGTHS)
    q, keys, values = make_inputs(sum(LENGTHS), n_pass, hq, hkv, seed=n_pass)
    dout = torch.randn_like(q)
    mask = staircase_mask(LENGTHS, n_pass)
    ops = LocalAttentionOps(block_q=32, block_k=16)

    got_in, ref_in = leaves([q, *keys, *values]), leaves([q, *keys, *values])
    split = lambda xs: (xs[0], xs[1 : 1 + n_pass], xs[1 + n_pass :])  # noqa: E731
    out = ttt_attention(*split(got_in), cu, ops=ops)
    ref = dense_ttt(*split(ref_in), mask)
    torch.testing.assert_close(out, ref, **TOL64)

    grads = torch.autograd.grad(out, got_in, dout)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL64)


def test_single_pass_is_causal_attention():
    cu = cu_of(LENGTHS)
    q, keys, values = make_inputs(sum(LENGTHS), 1, 4, 2, seed=9)
    torch.testing.assert_close(
        ttt_attention(q, keys, values, cu, scale=0.2),
        varlen_attention(q, keys[0], values[0], cu, causal=True, scale=0.2),
        **TOL64,
    )


def test_gradcheck_tiny():
    cu = cu_of([2, 3])
    q, keys, values = make_inputs(5, 3, 2, 1, dim=2, seed=10)
    inputs = leaves([q, *keys, *values])
    ops = LocalAttentionOps(block_q=4, block_k=2)
    fn = lambda q, *kv: ttt_attention(q, list(kv[:3]), list(kv[3:]), cu, ops=ops)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)


class RecordingOps(LocalAttentionOps):
    """Records trunk calls: the only way TTT may touch the keys shared across CP ranks."""

    def __init__(self):
        super().__init__(block_q=16, block_k=16)
        self.calls = []

    def forward(self, q, k, v, cu_q, cu_k, causal, scale=None):
        self.calls.append(("forward", causal))
        return super().forward(q, k, v, cu_q, cu_k, causal, scale)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale=None):
        self.calls.append(("backward", causal))
        return super().backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)


def test_trunk_goes_through_ops():
    cu = cu_of([5, 9])
    q, keys, values = make_inputs(14, 3, 2, 1, seed=11)
    q, *kv = leaves([q, *keys, *values])
    ops = RecordingOps()
    ttt_attention(q, kv[:3], kv[3:], cu, ops=ops).sum().backward()
    assert ops.calls == [("forward", True), ("backward", True)]
    assert all(t.grad is not None for t in (q, *kv))


def test_bf16_inputs():
    cu = cu_of(LENGTHS)
    q, keys, values = make_inputs(sum(LENGTHS), 3, 4, 2, dtype=torch.bfloat16, seed=12)
    inputs = leaves([q, *keys, *values])
    out = ttt_attention(inputs[0], inputs[1:4], inputs[4:], cu)
    assert out.dtype == torch.bfloat16
    ref = dense_ttt(q.double(), [k.double() for k in keys], [v.double() for v in values],
                    staircase_mask(LENGTHS, 3))
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    out.float().square().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 and t.grad.isfinite().all() for t in inputs)

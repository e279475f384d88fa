"""The Triton LSE merge (under TRITON_INTERPRET=1 on CPU, compiled on a GPU) against the torch
merge and against dense attention over the union of the key sets, forward and all gradients."""
import pytest
import torch

from spectrain.kernels.lse_merge_triton import triton_merge_attn
from spectrain.ops.lse_merge import merge_attn
from tests.helpers import dense_attention, dense_mask

INF = float("-inf")
TOL64 = dict(atol=1e-12, rtol=1e-12)


def partials(t: int, h: int, d: int, dtype=torch.float64, seed: int = 0, device="cpu"):
    """Two partial results with every -inf pattern: a empty, b empty, both empty, huge gaps."""
    gen = torch.Generator().manual_seed(seed)
    out_a, out_b = (torch.randn(t, h, d, generator=gen, dtype=torch.float64) for _ in range(2))
    lse_a, lse_b = (3 * torch.randn(t, h, generator=gen, dtype=torch.float64) for _ in range(2))
    lse_a[0, 0], lse_b[1, -1] = INF, INF
    lse_a[2], lse_b[2] = INF, INF
    lse_a[3, 0], lse_b[3, 0] = 1000.0, -1000.0
    out_a[lse_a == INF], out_b[lse_b == INF] = 0.0, 0.0  # contract: rows without keys are 0
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return [x.to(device=device, dtype=dtype if x.dim() == 3 else lse_dtype).requires_grad_()
            for x in (out_a, lse_a, out_b, lse_b)]


def merged_and_grads(merge, inputs, seed: int = 1):
    """The merge and the gradients of a random linear function of (out, finite lse) wrt all four inputs."""
    out, lse = merge(*inputs)
    gen = torch.Generator().manual_seed(seed)
    g_out, g_lse = (torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device, x.dtype) for x in (out, lse))
    loss = (out * g_out).sum() + torch.where(lse.isfinite(), lse * g_lse, 0.0).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, inputs)


def test_triton_merge_equals_torch_merge_with_empty_rows():
    got_out, got_lse, got_grads = merged_and_grads(triton_merge_attn, partials(6, 3, 5))
    want_out, want_lse, want_grads = merged_and_grads(merge_attn, partials(6, 3, 5))
    torch.testing.assert_close(got_out, want_out, **TOL64)
    torch.testing.assert_close(got_lse, want_lse, **TOL64)
    assert got_lse[2].eq(INF).all() and got_out[2].eq(0).all()  # both sides empty: stays empty
    assert got_lse[3, 0] == pytest.approx(1000.0) and torch.equal(got_out[3, 0], want_out[3, 0])
    for name, g, w in zip(("out", "lse", "block_out", "block_lse"), got_grads, want_grads):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, **TOL64, msg=name)


def test_triton_merge_of_two_key_sets_equals_dense_attention_with_gradients():
    """Causal packed documents, keys split in two interleaved sets: some rows see no key of one set."""
    lens = [5, 1, 6]
    t = sum(lens)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(t, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = dense_mask(lens, lens, causal=True)
    first = (torch.arange(t) % 2 == 0).expand(t, t)  # rows 0 and 5 see keys of one set only

    def split_then_merge(q, k, v):
        a, b = dense_attention(q, k, v, mask & first), dense_attention(q, k, v, mask & ~first)
        return triton_merge_attn(*a, *b)

    def dense(q, k, v):
        return dense_attention(q, k, v, mask)

    got_out, got_lse, got_grads = merged_and_grads(split_then_merge, (q, k, v))
    want_out, want_lse, want_grads = merged_and_grads(dense, (q, k, v))
    torch.testing.assert_close(got_out, want_out, **TOL64)
    torch.testing.assert_close(got_lse, want_lse, **TOL64)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-11, rtol=1e-11, msg=name)


def test_triton_merge_accumulates_in_float32():
    out_b = torch.randn(4, 2, 8, dtype=torch.float32)
    lse_b = torch.randn(4, 2)
    out, lse = triton_merge_attn(out_b.clone(), lse_b.clone(), out_b, lse_b)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, out_b)
    torch.testing.assert_close(lse, lse_b + torch.log(torch.tensor(2.0)))


@pytest.mark.gpu
@pytest.mark.parametrize("block_dtype", [torch.bfloat16, torch.float32])
def test_triton_merge_on_cuda_at_ring_sizes(block_dtype):
    """T=4096 tokens x 32 heads x 128: fp32 accumulation vs the float64 torch merge (tolerance 1e-5)."""
    cuda = partials(4096, 32, 128, dtype=block_dtype, seed=5, device="cuda")
    got_out, got_lse, got_grads = merged_and_grads(merge_attn, cuda)  # dispatches to Triton on CUDA
    assert got_out.dtype == torch.float32
    ref = [x.detach().cpu().double().requires_grad_() for x in cuda]
    want_out, want_lse, want_grads = merged_and_grads(merge_attn, ref)
    torch.testing.assert_close(got_out.cpu().double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse.cpu().double(), want_lse, atol=1e-5, rtol=1e-5)
    for name, g, w in zip(("out", "lse", "block_out", "block_lse"), got_grads, want_grads):
        tol = 1e-2 if g.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(g.cpu().double(), w, atol=tol, rtol=tol, msg=name)

"""Zigzag ring attention, CP TTT attention and the CP shift in real gloo processes.

One spawn per CP size runs every case and returns its local shards; the parent unshards
them and compares with a dense float64 single-process reference (the full mask is built
here only). Tolerance: float64, 1e-10 relative/absolute.
"""

import pytest
import torch
import torch.distributed as dist

from spectrain.ops.ttt_attention import ttt_attention
from spectrain.parallel.cp.ring import ZigzagRingAttentionOps, zigzag_ring_attention
from spectrain.parallel.cp.zigzag import ZigzagLayout, shard, shift_left, unshard
from spectrain.parallel.spawn import run_distributed

pytestmark = pytest.mark.slow

LENS = [5, 37, 64, 18]
HQ, HKV, D = 4, 2, 8
N_PASS = 4  # TTT depth d
SHIFTS = [1, 4, 7, -3]
TOL = dict(rtol=1e-10, atol=1e-10)


def _cu():
    return torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)


def _inputs():
    """Global float64 tensors, identical in every process."""
    g = torch.Generator().manual_seed(0)
    t = sum(LENS)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "q": rnd(t, HQ, D),
        "k": rnd(N_PASS, t, HKV, D),  # k[0]: trunk (pass 1); k[1:]: TTT passes 2..d
        "v": rnd(N_PASS, t, HKV, D),
        "dout": rnd(t, HQ, D),
        "x": rnd(t, 3),
        "dx": rnd(t, 3),
    }


# ---------------------------------------------------------------- worker (one per rank)


def _leaf(x):
    return x.clone().requires_grad_()


def _cp_worker(rank, world):
    group = dist.group.WORLD
    lay = ZigzagLayout.build(_cu(), world, rank)
    cu = lay.cu_seqlens_local
    inp = {name: shard(x, lay) for name, x in _inputs().items() if name not in ("k", "v")}
    for name in ("k", "v"):  # [P, T, H, D]: shard the token dim
        inp[name] = shard(_inputs()[name].transpose(0, 1), lay).transpose(0, 1).contiguous()
    res = {}

    # ring attention: autograd wrapper for out/grads, the ops object for lse
    q, k, v = _leaf(inp["q"]), _leaf(inp["k"][0]), _leaf(inp["v"][0])
    out = zigzag_ring_attention(q, k, v, cu, group)
    out.backward(inp["dout"])
    _, lse = ZigzagRingAttentionOps(group).forward(inp["q"], inp["k"][0], inp["v"][0], cu, cu, True)
    res["attn"] = dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)
    with pytest.raises(ValueError, match="causal-only"):
        ZigzagRingAttentionOps(group).forward(inp["q"], inp["k"][0], inp["v"][0], cu, cu, False)
    with pytest.raises(ValueError, match="even local length"):
        odd = torch.tensor([0, 3, lay.num_local_tokens], dtype=torch.int32)
        ZigzagRingAttentionOps(group).forward(inp["q"], inp["k"][0], inp["v"][0], odd, odd, True)

    # same in float32: dtypes follow the contract
    q32, k32, v32 = inp["q"].float(), inp["k"][0].float(), inp["v"][0].float()
    out32, lse32 = ZigzagRingAttentionOps(group).forward(q32, k32, v32, cu, cu, True)
    res["attn32"] = dict(out=out32, lse=lse32)

    # TTT branch attention with the ring as trunk ops
    for d in (2, N_PASS):
        q = _leaf(inp["q"])
        ks = [_leaf(x) for x in inp["k"][:d]]
        vs = [_leaf(x) for x in inp["v"][:d]]
        out = ttt_attention(q, ks, vs, cu, ops=ZigzagRingAttentionOps(group))
        out.backward(inp["dout"])
        res[f"ttt{d}"] = dict(out=out.detach(), dq=q.grad, dk=torch.stack([x.grad for x in ks]),
                              dv=torch.stack([x.grad for x in vs]))

    # CP-aware shift, forward and backward
    for s in SHIFTS:
        x = _leaf(inp["x"])
        y = shift_left(x, lay, s, group, fill=0.0)
        y.backward(inp["dx"])
        res[f"shift{s}"] = dict(out=y.detach(), grad=x.grad)
    return res


# ---------------------------------------------------------------- dense reference


def _dense(q, k_trunk, v_trunk, k_branch, v_branch):
    """Per-document dense TTT attention: causal trunk + diagonal branch keys; (out, lse)."""
    g = HQ // HKV
    outs, lses = [], []
    cu = _cu().tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        qd = q[s:e]
        kt, vt = k_trunk[s:e].repeat_interleave(g, 1), v_trunk[s:e].repeat_interleave(g, 1)
        scores = torch.einsum("ihd,jhd->hij", qd, kt) * D**-0.5
        mask = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        values = vt.unsqueeze(0).expand(e - s, -1, -1, -1)  # [i, j, h, d]
        if k_branch is not None:
            kb = k_branch[:, s:e].repeat_interleave(g, 2)  # [P, i, h, d]
            vb = v_branch[:, s:e].repeat_interleave(g, 2)
            diag = torch.einsum("ihd,pihd->hip", qd, kb) * D**-0.5
            scores = torch.cat([scores, diag], dim=-1)
            values = torch.cat([values, vb.transpose(0, 1)], dim=1)
        p = scores.softmax(-1)
        outs.append(torch.einsum("hij,ijhd->ihd", p, values))
        lses.append(scores.logsumexp(-1).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _reference_grads(d):
    inp = _inputs()
    q, k, v = _leaf(inp["q"]), _leaf(inp["k"][:d]), _leaf(inp["v"][:d])
    kb, vb = (k[1:], v[1:]) if d > 1 else (None, None)
    out, lse = _dense(q, k[0], v[0], kb, vb)
    out.backward(inp["dout"])
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _global_shift(x, s):
    cu = _cu().long()
    idx = torch.arange(x.shape[0])
    doc = torch.searchsorted(cu[1:], idx, right=True)
    ok = (idx + s >= cu[doc]) & (idx + s < cu[doc + 1])
    return torch.where(ok[:, None], x[(idx + s).clamp(0, x.shape[0] - 1)], 0.0)


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"cp{p}")
def cp_run(request):
    world = request.param
    results = run_distributed(_cp_worker, world, timeout=120)
    layout = ZigzagLayout.build(_cu(), world, 0)

    def gathered(case, key, dim=0):
        """The global tensor of one result, unsharded along its token dim ``dim``."""
        return unshard([r[case][key].movedim(dim, 0) for r in results], layout).movedim(0, dim)

    return gathered


def test_ring_attention_forward_backward(cp_run):
    ref = _reference_grads(1)
    torch.testing.assert_close(cp_run("attn", "out"), ref["out"], **TOL)
    torch.testing.assert_close(cp_run("attn", "lse"), ref["lse"], **TOL)
    torch.testing.assert_close(cp_run("attn", "dq"), ref["dq"], **TOL)
    torch.testing.assert_close(cp_run("attn", "dk"), ref["dk"][0], **TOL)
    torch.testing.assert_close(cp_run("attn", "dv"), ref["dv"][0], **TOL)


def test_ring_attention_float32(cp_run):
    ref = _reference_grads(1)
    out, lse = cp_run("attn32", "out"), cp_run("attn32", "lse")
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref["out"].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref["lse"].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [2, N_PASS])
def test_ttt_attention_under_cp(cp_run, d):
    ref = _reference_grads(d)
    torch.testing.assert_close(cp_run(f"ttt{d}", "out"), ref["out"], **TOL)
    torch.testing.assert_close(cp_run(f"ttt{d}", "dq"), ref["dq"], **TOL)
    torch.testing.assert_close(cp_run(f"ttt{d}", "dk", dim=1), ref["dk"], **TOL)
    torch.testing.assert_close(cp_run(f"ttt{d}", "dv", dim=1), ref["dv"], **TOL)


@pytest.mark.parametrize("s", SHIFTS)
def test_cp_shift_matches_global_shift(cp_run, s):
    inp = _inputs()
    x = _leaf(inp["x"])
    ref = _global_shift(x, s)
    ref.backward(inp["dx"])
    torch.testing.assert_close(cp_run(f"shift{s}", "out"), ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(cp_run(f"shift{s}", "grad"), x.grad, **TOL)

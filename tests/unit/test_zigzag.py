"""Zigzag CP layout: chunks, padding, shard/unshard, shift routes, errors (single process)."""

import pytest
import torch

from spectrain.parallel.cp.zigzag import ShiftRoutes, ZigzagLayout, shard, shift_left, unshard

LENS = [5, 37, 64, 18]


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def global_shift(x, cu, shift, fill=0):
    """Reference: row i takes row i+shift of the same document, else ``fill``."""
    out = torch.full_like(x, fill)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for i in range(s, e):
            if s <= i + shift < e:
                out[i] = x[i + shift]
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_chunks_of_one_document(cp):
    n = 4 * cp  # chunk length 2
    for rank in range(cp):
        lay = ZigzagLayout.build(cu_of([n]), cp, rank)
        front = [2 * rank, 2 * rank + 1]
        back = [2 * (2 * cp - 1 - rank), 2 * (2 * cp - 1 - rank) + 1]
        assert lay.position_ids.tolist() == front + back
        assert lay.cu_seqlens_local.tolist() == [0, 4]
        assert lay.valid.all()


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_padding_and_cover(cp):
    cu = cu_of(LENS)
    padded = [-(-n // (2 * cp)) * (2 * cp) for n in LENS]
    layouts = [ZigzagLayout.build(cu, cp, r) for r in range(cp)]
    for lay in layouts:
        assert lay.cu_seqlens_padded.tolist() == cu_of(padded).tolist()
        assert lay.cu_seqlens_local.dtype == torch.int32
        assert lay.cu_seqlens_local.tolist() == layouts[0].cu_seqlens_local.tolist()
        assert lay.num_local_tokens == sum(padded) // cp
        # pads sit at the end of their document; real tokens map to their global row
        doc_len = torch.tensor(LENS)[lay.doc_ids]
        assert torch.equal(lay.valid, lay.position_ids < doc_len)
        real = lay.valid
        expected = cu.long()[lay.doc_ids[real]] + lay.position_ids[real]
        assert torch.equal(lay.global_index[real], expected)
        assert (lay.global_index[~real] == -1).all()
    # every real token is held by exactly one rank
    held = torch.cat([lay.global_index[lay.valid] for lay in layouts])
    assert sorted(held.tolist()) == list(range(sum(LENS)))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_unshard_round_trip(cp):
    cu = cu_of(LENS)
    x = torch.randn(sum(LENS), 3, 2)
    ids = torch.arange(sum(LENS))
    layouts = [ZigzagLayout.build(cu, cp, r) for r in range(cp)]
    shards = [shard(x, lay) for lay in layouts]
    assert torch.equal(unshard(shards, layouts[1 % cp]), x)
    for lay in layouts:
        s_ids = shard(ids, lay, pad_value=-7)
        assert (s_ids[~lay.valid] == -7).all()
        assert torch.equal(s_ids[lay.valid], lay.global_index[lay.valid])
        mask = shard(torch.ones(sum(LENS), dtype=torch.bool), lay, pad_value=False)
        assert torch.equal(mask, lay.valid)


def test_empty_document_and_cp1_is_identity():
    cu = cu_of([3, 0, 4])
    lay = ZigzagLayout.build(cu, 1, 0)
    assert lay.cu_seqlens_local.tolist() == [0, 4, 4, 8]
    x = torch.arange(7.0)
    assert shard(x, lay).tolist() == [0, 1, 2, 0, 3, 4, 5, 6]


def _simulate_shift(layouts, xs, shift, fill):
    """Run every rank's ShiftRoutes with the sends delivered in memory."""
    routes = [ShiftRoutes.build(lay, shift) for lay in layouts]
    outs = []
    for me, (mine, x) in enumerate(zip(routes, xs)):
        out = torch.empty_like(x)
        out[mine.fill_rows] = fill
        out[mine.local_dst] = x[mine.local_src]
        for peer, dst in mine.recv.items():
            out[dst] = xs[peer][routes[peer].send[me]]
        outs.append(out)
    return routes, outs


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("shift", [1, 3, 7, -2])
def test_shift_routes_match_global_shift(cp, shift):
    cu = cu_of(LENS)  # the 5-token doc has chunk length 1 at cp=4: shifts span several ranks
    x = torch.randn(sum(LENS), 2)
    layouts = [ZigzagLayout.build(cu, cp, r) for r in range(cp)]
    routes, outs = _simulate_shift(layouts, [shard(x, lay) for lay in layouts], shift, -1.0)
    ref = [shard(global_shift(x, cu, shift, -1.0), lay, pad_value=-1.0) for lay in layouts]
    for out, r in zip(outs, ref):
        assert torch.equal(out, r)
    # only boundary rows travel: at most |shift| rows per chunk
    n_recv = [sum(len(d) for d in p.recv.values()) for p in routes]
    assert max(n_recv) <= 2 * abs(shift) * len(LENS)


def test_shift_left_single_rank_with_grad():
    cu = cu_of(LENS)
    lay = ZigzagLayout.build(cu, 1, 0)
    x = torch.randn(sum(LENS), 2, dtype=torch.float64)
    xs = shard(x, lay).requires_grad_()
    out = shift_left(xs, lay, 4, group=None, fill=0.0)
    assert torch.equal(out, shard(global_shift(x, cu, 4), lay))
    g = torch.randn_like(out)
    out.backward(g)
    # row i+4 receives g[i] when it is a real token of row i's document
    keep = lay.valid.roll(-4) & (lay.doc_ids == lay.doc_ids.roll(-4))
    ref = torch.zeros_like(xs)
    ref[4:] = torch.where(keep[:-4, None], g[:-4], 0.0)
    assert torch.allclose(xs.grad, ref)
    ids = torch.arange(sum(LENS))  # integer ids (no autograd) shift the same way
    shifted = shift_left(shard(ids, lay, pad_value=-1), lay, 2, group=None, fill=-1)
    assert torch.equal(shifted, shard(global_shift(ids, cu, 2, -1), lay, pad_value=-1))


def test_errors_name_the_fix():
    cu = cu_of(LENS)
    with pytest.raises(ValueError, match="cp_size=1"):
        ZigzagLayout.build(cu, 0, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        ZigzagLayout.build(cu, 2, 2)
    with pytest.raises(ValueError, match=r"document 2 .* padded to 64 .* max_seqlen to >= 64"):
        ZigzagLayout.build(cu, 4, 0, max_seqlen=63)
    with pytest.raises(ValueError, match=r"padded to 40 .*max_seqlen=39"):
        ZigzagLayout.build(cu_of([37]), 4, 0, max_seqlen=39)
    ZigzagLayout.build(cu, 4, 0, max_seqlen=64)
    with pytest.raises(ValueError, match="start at 0"):
        ZigzagLayout.build(torch.tensor([1, 5]), 2, 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        ZigzagLayout.build(torch.tensor([0, 5, 3]), 2, 0)
    lay = ZigzagLayout.build(cu, 2, 0)
    with pytest.raises(ValueError, match="rows"):
        shard(torch.zeros(3), lay)
    with pytest.raises(ValueError, match="one per CP rank"):
        unshard([shard(torch.zeros(sum(LENS)), lay)], lay)
    with pytest.raises(ValueError, match="process group"):
        shift_left(torch.zeros(lay.num_local_tokens), lay, 1, group=None)

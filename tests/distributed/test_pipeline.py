"""Pipeline parallel + TapChannel against the single-process policy (float64, 2 gloo ranks).

Tolerances: float64 throughout; microbatches are padded and split differently from the
full batch, which only reorders sums, so losses, gradients and taps agree to 1e-10.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spectrain.batch import RolloutBatch
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM, pack_sequences
from spectrain.parallel.pp.runner import PipelineRunner, make_tap_channel, split_microbatches
from spectrain.parallel.pp.stages import (
    EMBEDS_TAP,
    layer_tap_name,
    local_stage_indices,
    split_policy,
    stage_layer_ids,
    tap_names_by_stage,
)
from spectrain.parallel.pp.tap_channel import BlockingTapTransport, TapChannel, new_tap_group
from spectrain.parallel.spawn import run_distributed

CFG = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CAPTURE = (1, 2, 3)
TOKENS_PER_MB = 32
DOC_LENGTHS = (5, 9, 4, 7, 11, 3, 6, 8)
TOL = dict(rtol=1e-10, atol=1e-12)


def _policy() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG)).double()
    for p in model.parameters():  # norms start at exactly 1; perturb so their grads are tested
        if p.dim() == 1:
            p.data.add_(0.1 * torch.randn_like(p))
    return model


def _draft_head() -> torch.nn.Linear:
    torch.manual_seed(1)
    return torch.nn.Linear(4 * CFG["hidden_size"], CFG["vocab_size"], dtype=torch.float64)


def _batch(seed: int = 2) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, CFG["vocab_size"], (n,), generator=g).tolist() for n in DOC_LENGTHS]
    ids, pos, cu = pack_sequences(seqs)
    targets = torch.full_like(ids, -1)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        targets[s:e - 1] = ids[s + 1:e]
    mask = targets >= 0
    zeros = torch.zeros(ids.numel())
    return RolloutBatch(ids, pos, cu, targets, mask, zeros, zeros)


def _loss(out, mb, draft, n_tokens: int, record: list):
    """Token CE of the policy + a draft-like CE from cat(embeds, aux), global-count normalised."""
    m = mb.response_mask
    loss = F.cross_entropy(out.logits[m], mb.targets[m], reduction="sum") / n_tokens
    if draft is not None:
        feats = torch.cat([out.embeds, *out.tap_hidden], dim=-1)
        loss = loss + F.cross_entropy(draft(feats)[m], mb.targets[m], reduction="sum") / n_tokens
        record.append((out.embeds, out.tap_hidden))  # kept as they are, like the draft's inputs
    return loss


def _reference():
    """Single-process loss, grads and per-document taps."""
    model, draft, batch = _policy(), _draft_head(), _batch()
    out = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=CAPTURE)
    out.embeds, out.tap_hidden = out.embeds.detach(), [a.detach() for a in out.tap_hidden]
    loss = _loss(out, batch, draft, batch.num_response_tokens, [])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, draft.weight.grad.clone(), out.embeds, out.tap_hidden


# ------------------------------------------------------------------ fast, single process
def test_stage_split_keeps_hf_names_and_matches_model():
    model = _policy()
    assert [list(stage_layer_ids(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    stages = [split_policy(model, 2, s, CAPTURE) for s in range(2)]
    names = [set(s.state_dict()) for s in stages]
    assert "model.embed_tokens.weight" in names[0] and "model.layers.1.mlp.up_proj.weight" in names[0]
    assert "lm_head.weight" in names[1] and "model.norm.weight" in names[1]
    assert names[0] | names[1] == set(model.state_dict()) and not names[0] & names[1]
    assert stages[0].tap_names == (EMBEDS_TAP, layer_tap_name(1))
    assert stages[1].tap_names == (layer_tap_name(2), layer_tap_name(3))
    batch = _batch()
    taps = {}
    for s in stages:
        s.tap_sink = lambda mb, name, t: taps.__setitem__(name, t)
    h = stages[0](batch.input_ids, batch.position_ids, batch.cu_seqlens, torch.tensor([0]))
    logits, _ = stages[1](h, batch.position_ids, batch.cu_seqlens, torch.tensor([0]))
    ref = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=CAPTURE)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(taps[EMBEDS_TAP], ref.embeds, rtol=0, atol=0)
    for layer, aux in zip(CAPTURE, ref.tap_hidden):
        torch.testing.assert_close(taps[layer_tap_name(layer)], aux, rtol=0, atol=0)


def test_tap_names_dedup_and_order():
    assert tap_names_by_stage(4, 2, (2, 2, 1)) == {0: (EMBEDS_TAP, "layers.1"), 1: ("layers.2",)}
    assert tap_names_by_stage(4, 2, ()) == {0: (), 1: ()}
    assert local_stage_indices(1, 2, 2) == [1, 3]


def test_split_errors_name_the_fix():
    model = _policy()
    with pytest.raises(ValueError, match="cannot split 4 decoder layers into 5 pipeline stages"):
        split_policy(model, 5, 0)
    with pytest.raises(ValueError, match=r"aux layer ids \[4, 7\] do not exist.*tap_layers"):
        split_policy(model, 2, 1, tap_layers=(1, 4, 7))
    with pytest.raises(ValueError, match="out of range"):
        split_policy(model, 2, 2)
    tied = LlamaForCausalLM(LlamaConfig(**CFG, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="untie"):
        split_policy(tied, 2, 0)


def test_split_microbatches():
    cu = _batch().cu_seqlens
    groups = split_microbatches(cu, 4, TOKENS_PER_MB)
    assert sum(groups, []) == list(range(len(DOC_LENGTHS))) and len(groups) == 4 and all(groups)
    lengths = torch.tensor(DOC_LENGTHS)
    assert all(int(lengths[g].sum()) <= TOKENS_PER_MB for g in groups)
    assert split_microbatches(cu, 8, TOKENS_PER_MB) == [[i] for i in range(8)]
    with pytest.raises(ValueError, match="cannot fill 9 microbatches"):
        split_microbatches(cu, 9, TOKENS_PER_MB)
    with pytest.raises(ValueError, match="raise tokens_per_microbatch or n_microbatches"):
        split_microbatches(cu, 2, 24)
    with pytest.raises(ValueError, match="exceeds tokens_per_microbatch=8"):
        split_microbatches(cu, 4, 8)


@pytest.fixture
def one_process_group():
    """A gloo WORLD of this process alone (a TapChannel needs a group), torn down afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_local_tap_is_owned_by_the_channel(one_process_group):
    """A tap the last stage posts itself (its input: pipelining's receive buffer, refilled by the next
    `schedule.step()`) must come out of `wait` as it was posted, whatever later writes the buffer."""
    name = layer_tap_name(2)
    channel = TapChannel(one_process_group, {1: (name,)}, 1, hidden_size=4, capacity_tokens=3, dtype=torch.float64)
    assert channel.is_destination and channel.stage_rank(1) == channel.rank  # posted locally, not sent
    stage_input = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    posted = stage_input.clone()
    channel.begin_step({0: [(1, 0)]})
    channel.post(0, name, stage_input)
    stage_input.fill_(-1.0)  # the next microbatch's (or step's) activations land in the same buffer
    tap = channel.wait(0)[name]
    channel.finish_step()
    torch.testing.assert_close(tap, posted, rtol=0, atol=0)


@pytest.mark.parametrize("name, per_rank, n_mb, match", [
    ("PipeDream", 1, 2, "unknown pipeline schedule 'PipeDream'"),
    ("Interleaved1F1B", 1, 2, "needs >= 2 stages per rank"),
    ("GPipe", 2, 2, "use Interleaved1F1B"),
    ("1F1B", 1, 1, "1F1B needs n_microbatches >= 2"),
])
def test_runner_rejects_bad_schedules(name, per_rank, n_mb, match):
    model = _policy()
    num_stages = 2 * per_rank
    stages = [split_policy(model, num_stages, s) for s in local_stage_indices(0, 2, per_rank)]
    with pytest.raises(ValueError, match=match):  # raised before any process group is touched
        PipelineRunner(stages, name, n_mb, TOKENS_PER_MB, loss_fn=None, pp_group=None)


# ------------------------------------------------------------------ multi-process
CASES = [("GPipe", 2, 1, TapChannel), ("1F1B", 4, 1, TapChannel), ("1F1B", 2, 1, BlockingTapTransport),
         ("Interleaved1F1B", 4, 2, TapChannel)]


def _pp_worker(rank: int, world_size: int):
    pp_group = dist.group.WORLD
    tap_group = new_tap_group(pp_group)
    results = {}
    for schedule, n_mb, per_rank, transport in CASES:
        model, draft, batch = _policy(), _draft_head(), _batch()
        num_stages = world_size * per_rank
        local = local_stage_indices(rank, world_size, per_rank)
        stages = [split_policy(model, num_stages, s, CAPTURE) for s in local]
        channel = make_tap_channel(stages[0], tap_group, TOKENS_PER_MB, transport)
        record: list = []
        n_tokens = batch.num_response_tokens
        runner = PipelineRunner(stages, schedule, n_mb, TOKENS_PER_MB,
                                lambda out, mb: _loss(out, mb, draft, n_tokens, record), pp_group, channel)
        losses = runner.step(batch)
        grads = {n: p.grad.clone() for s in stages for n, p in s.named_parameters()}
        draft_grad = draft.weight.grad.clone() if losses else None
        taps = list(record)
        # A second step (the next GRPO minibatch) refills pipelining's receive buffers; the first step's
        # taps, which the draft trains on only after the last minibatch, must not change.
        runner.step(_batch(seed=3))
        results[(schedule, n_mb, transport.__name__)] = dict(losses=losses, grads=grads, taps=taps,
                                                             draft_grad=draft_grad)

    # Ranks that disagree on the forward order: the receiver must name expected vs got.
    channel = TapChannel(tap_group, {0: (EMBEDS_TAP,)}, 1, hidden_size=4, capacity_tokens=3,
                         dtype=torch.float64)
    channel.begin_step({0: [(0, 1), (0, 0)] if rank == 0 else [(0, 0), (0, 1)]})
    if rank == 0:
        channel.post(1, EMBEDS_TAP, torch.ones(2, 4, dtype=torch.float64))
        channel.post(0, EMBEDS_TAP, torch.zeros(3, 4, dtype=torch.float64))
        channel.finish_step()
    else:
        try:
            channel.wait(0)
        except RuntimeError as e:
            results["mismatch"] = str(e)
    return results


@pytest.mark.slow
def test_pipeline_matches_single_process():
    ref_loss, ref_grads, ref_draft_grad, ref_embeds, ref_aux = _reference()
    cu = _batch().cu_seqlens
    first, last = run_distributed(_pp_worker, 2, timeout=120)
    for key in [(s, n, t.__name__) for s, n, _, t in CASES]:
        got = last[key]
        assert first[key]["losses"] is None and len(got["losses"]) == key[1]
        torch.testing.assert_close(sum(got["losses"]), ref_loss, **TOL, msg=f"{key} loss")
        grads = {**first[key]["grads"], **got["grads"]}
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], **TOL, msg=f"{key} grad {name}")
        torch.testing.assert_close(got["draft_grad"], ref_draft_grad, **TOL, msg=f"{key} draft grad")
        groups = split_microbatches(cu, key[1], TOKENS_PER_MB)
        assert len(got["taps"]) == len(groups)
        for g, (embeds, aux) in zip(groups, got["taps"]):  # microbatches arrive in order
            rows = torch.arange(int(cu[g[0]]), int(cu[g[-1] + 1]))
            torch.testing.assert_close(embeds, ref_embeds[rows], **TOL)
            for a, r in zip(aux, ref_aux):
                torch.testing.assert_close(a, r[rows], **TOL)
    assert last["mismatch"] == (
        "TapChannel: expected tap 'embeds' of microbatch 0 from stage 0, got tap 'embeds' of "
        "microbatch 1 from stage 0: the pp ranks disagree on the schedule's forward order")

"""`PipelinePlan` against `LocalPlan`: the GRPO step pipelined over real gloo processes.

A tiny float64 policy (hidden 32, 4 layers) and EAGLE-3 draft, a fake rollout (no vLLM).
Per case: policy loss, every policy gradient (after `reduce_gradients`), the global clip
norm and clipped gradients, the draft loss, metrics and gradients (from the taps that
crossed the TapChannel), and the weights gathered to rank 0 after an SGD update must equal
the single-process ones. Tolerance 1e-10 relative: float64, and microbatching, padding and
zigzag sharding only reorder sums.
"""
import pytest
import torch
from torch.distributed.tensor import DTensor

from spectrain.batch import concat_batches
from spectrain.config import ConfigError, load_config
from spectrain.parallel.fsdp import full_tensor, gathered_state_dict, is_sharded, shard_modules
from spectrain.parallel.mesh import build_mesh
from spectrain.parallel.plan import LocalPlan, TapCollector
from spectrain.parallel.pp.plan import PipelinePlan, microbatch_budget
from spectrain.parallel.pp.runner import split_microbatches
from spectrain.parallel.spawn import run_distributed
from tests.helpers import StandInModule, float64_grpo_loss_fn, mixed_length_batch

POLICY = dict(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
CAPTURE = (1, 2, 3)  # embeds + layers.1 cross the TapChannel at pp=2; layers.2, .3 are local to the last stage
TTT_STEPS, PASS_DECAY = 3, 0.8
MAX_NORM, LR = 1e-2, 0.1  # MAX_NORM is far below the gradient norm: clipping always acts
TOL = dict(rtol=1e-10, atol=1e-12)


def _models(seed: int) -> StandInModule:
    return StandInModule(POLICY, CAPTURE, seed)


def _batch():
    """Eight documents of mixed lengths."""
    return mixed_length_batch([(4, 9), (6, 1), (3, 22), (5, 12), (2, 2), (7, 17), (3, 5), (4, 8)], POLICY["vocab_size"])


def _grads(module):
    """Whole gradients (collective for shards: every copy of a stage calls it in the same order)."""
    return {n: full_tensor(p.grad, keep=True).clone() for n, p in module.named_parameters() if p.grad is not None}


def _step(plan, models, batch, micro_batch_tokens=None):
    """Policy step, clip, draft step (where the draft lives), SGD, then weight sync; what each produced."""
    out = {}
    taps = TapCollector(batch)
    result = plan.policy_forward_backward(models.policy, batch, float64_grpo_loss_fn(batch.num_response_tokens),
                                          CAPTURE, lambda loss: loss.backward(), taps, micro_batch_tokens)
    plan.reduce_gradients(models.policy)
    out.update(policy_loss=result.loss.double(), logprobs=result.logprobs, batch=result.batch,
               policy_grads=_grads(models.policy))
    out["grad_norm"] = plan.clip_grad_norm(models.policy, MAX_NORM)
    out["clipped_grads"] = _grads(models.policy)
    if plan.hosts_draft:
        from spectrain.train.draft_update import draft_loss  # imports lightning: only where the draft is

        models.draft_inputs = taps.chunks
        loss, metrics = draft_loss(models.draft, models.draft_inputs, TTT_STEPS, PASS_DECAY)
        loss.backward()
        plan.reduce_gradients(models.draft)
        out.update(draft_loss=loss.detach(), draft_grads=_grads(models.draft),
                   draft_metrics=torch.stack([metrics.loss_sum, metrics.correct.double(), metrics.count.double()]))
    with torch.no_grad():  # an update only this rank's stage (and draft, on the last stage) sees
        for p in models.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    for which, weights in (("policy_weights", plan.policy_weights(models.policy)),
                           ("draft_weights", plan.draft_weights(models.draft))):  # copies: the next update moves them
        out[which] = None if weights is None else [(n, t.clone()) for n, t in weights]
    return out


def _reference():
    models = _models(seed=0)
    return _step(LocalPlan(), models, _batch())


def _pp_worker(rank, world, cases):
    outs = []
    for (pp, dp, cp), schedule, n_mb, micro_batch_tokens in cases:
        models = _models(seed=rank)  # different weights per rank: prepare() must make them rank 0's
        plan = PipelinePlan(build_mesh(pp, dp, cp), schedule, n_mb)
        plan.prepare(models)
        assert plan.share({"from": rank}) == {"from": 0}
        outs.append(dict(_step(plan, models, _batch(), micro_batch_tokens), hosts_draft=plan.hosts_draft,
                         is_rollout_rank=plan.is_rollout_rank))
    return outs


def _close(got, want, what):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for k in want:
            _close(got[k], want[k], f"{what}.{k}")
    elif isinstance(want, list):  # [(name, tensor)] of weight sync
        assert [n for n, _ in got] == [n for n, _ in want], what
        for (n, g), (_, w) in zip(got, want):
            _close(g, w, f"{what}.{n}")
    else:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _check(case, outs, want):
    """Each rank's share against the single-process step."""
    what = f"mesh (pp, dp, cp)={case[0]} {case[1]} micro_batch_tokens={case[3]}"
    seen = set()
    for rank, got in enumerate(outs):
        assert got["is_rollout_rank"] == (rank == 0)
        _close(got["policy_loss"], want["policy_loss"], f"{what} rank {rank} policy loss")
        _close(got["grad_norm"], want["grad_norm"], f"{what} rank {rank} grad norm")
        for key in ("policy_grads", "clipped_grads"):
            for name, g in got[key].items():
                _close(g, want[key][name], f"{what} rank {rank} {key} {name}")
        seen |= got["policy_grads"].keys()
        sync = got["policy_weights"], got["draft_weights"]
        if rank == 0:
            _close(sync[0], want["policy_weights"], f"{what} policy weights on rank 0")
            _close(sync[1], want["draft_weights"], f"{what} draft weights on rank 0")
        else:
            assert sync == (None, None), f"{what}: only rank 0 gets the weights"
    assert seen == want["policy_grads"].keys(), f"{what}: stages cover the policy"
    hosts = [o for o in outs if o["hosts_draft"]]
    assert len(hosts) == len(outs) // case[0][0], f"{what}: the last stage's ranks host the draft"
    _close(sum(o["draft_loss"] for o in hosts), want["draft_loss"], f"{what} draft loss")
    _close(sum(o["draft_metrics"] for o in hosts), want["draft_metrics"], f"{what} draft metrics")
    for o in hosts:
        _close(o["draft_grads"], want["draft_grads"], f"{what} draft grads")
    if case[0][1:] == (1, 1):  # one copy of the last stage: its microbatches are the whole batch, in order
        _close(hosts[0]["logprobs"], want["logprobs"], f"{what} logprobs")
        assert torch.equal(hosts[0]["batch"].input_ids, want["batch"].input_ids)
    assert all(o["logprobs"].numel() == o["batch"].num_docs == 0 for o in outs if not o["hosts_draft"])


# One 4-process run (spawning is most of the cost): pure PP over 4 stages, PP=2 with DP=2, PP=2 with CP=2; the last
# two in rounds of microbatches of at most 32 (dp=2: [13, 7], [25, 17] on rank 0) or 16 tokens per rank (cp=2: the
# 8 zigzag shards of 2..14 tokens in 3 rounds), whose gradients accumulate.
CASES = [((4, 1, 1), "GPipe", 2, None), ((4, 1, 1), "1F1B", 4, None), ((2, 2, 1), "GPipe", 2, None),
         ((2, 2, 1), "Interleaved1F1B", 4, None), ((2, 1, 2), "1F1B", 2, None), ((2, 2, 1), "GPipe", 2, 32),
         ((2, 1, 2), "1F1B", 2, 16)]


@pytest.mark.slow
def test_pipeline_plan_matches_local_plan():
    want = _reference()
    assert want["grad_norm"] > 10 * MAX_NORM and want["draft_metrics"][2, 0] > 0
    per_rank = run_distributed(_pp_worker, 4, CASES, timeout=300)
    for i, case in enumerate(CASES):
        _check(case, [outs[i] for outs in per_rank], want)


FSDP_CASE, UPDATES = ((2, 2, 1), "1F1B", 2, None), 2


def _pp_fsdp_worker(rank, world):
    """pp=2 with FSDP over dp=2: each stage, and the last stage's draft, sharded over the stage's two copies."""
    models = _models(seed=rank)
    (pp, dp, cp), schedule, n_mb, _ = FSDP_CASE
    plan = PipelinePlan(build_mesh(pp, dp, cp), schedule, n_mb)
    plan.prepare(models)
    shard_modules(plan, models.policy, models.draft)
    layers = models.policy.model.layers  # 0, 1 on pp rank 0; 2, 3 on pp rank 1
    mine, other = (layers[str(i)].mlp.up_proj.weight for i in (2 * plan.pp_rank, 2 - 2 * plan.pp_rank))
    sharded = (isinstance(mine, DTensor), isinstance(other, DTensor), is_sharded(models.draft) == plan.hosts_draft)
    steps = [dict(_step(plan, models, _batch()), hosts_draft=plan.hosts_draft, is_rollout_rank=plan.is_rollout_rank)
             for _ in range(UPDATES)]
    return dict(sharded=sharded, steps=steps, state=gathered_state_dict(models, keep=rank == 0))


@pytest.mark.slow
def test_pipeline_stages_sharded_by_fsdp_match_local_plan():
    """pp x fsdp: two policy and draft updates (taps across the TapChannel, shards' gradients reduce-scattered,
    the clip norm over stages and shards) equal the single process's, to the tolerance above; rank 0's weight
    sync and its checkpoint state dict (gathered from the shards) hold the updated model in the unsharded format."""
    models = _models(seed=0)
    want = [_step(LocalPlan(), models, _batch()) for _ in range(UPDATES)]
    per_rank = run_distributed(_pp_fsdp_worker, 4, timeout=300)
    for rank, got in enumerate(per_rank):
        assert got["sharded"] == (True, False, True), f"rank {rank}: only its stage (and draft) are sharded"
    for i in range(UPDATES):
        _check(FSDP_CASE, [got["steps"][i] for got in per_rank], want[i])
    _close(per_rank[0]["state"], models.state_dict(), "rank 0's checkpoint state dict")


# ------------------------------------------------------------------ fast, single process
def test_microbatch_budget_is_the_smallest_fitting_multiple():
    cu = _batch().cu_seqlens
    for n_mb in (1, 2, 4, 8):
        budget = microbatch_budget(cu, n_mb, multiple=8)
        assert budget % 8 == 0
        split_microbatches(cu, n_mb, budget)
        with pytest.raises(ValueError):
            split_microbatches(cu, n_mb, budget - 8)
    with pytest.raises(ValueError, match="cannot fill 9 microbatches"):
        microbatch_budget(cu, 9)


def test_concat_batches_undoes_select():
    batch = _batch()
    parts = [batch.select(g) for g in split_microbatches(batch.cu_seqlens, 3, 64)]
    joined = concat_batches(parts, batch)
    for name in ("input_ids", "position_ids", "cu_seqlens", "targets", "response_mask", "advantages"):
        assert torch.equal(getattr(joined, name), getattr(batch, name)), name
    assert concat_batches([], batch).num_docs == 0


@pytest.mark.parametrize("overrides, match", [
    (["parallel.pp=5"], r"parallel.pp: 5 pipeline stages but the policy has only 4 layers; lower parallel.pp"),
    (["parallel.pp=3", "parallel.pp_schedule=Interleaved1F1B"], r"6 pipeline stages \(Interleaved1F1B runs 2"),
    (["parallel.pp=2", "parallel.microbatches=1"], r"1F1B needs at least one microbatch per stage \(2\), got 1"),
    (["parallel.pp=2", "parallel.pp_schedule=ZeroBubble"], r"parallel.pp_schedule: 'ZeroBubble' is not one of"),
    (["parallel.pp=2", "draft.tap_layers=[1,2,7]"], r"draft.tap_layers: \[1, 2, 7\] must be 3 layer ids"),
    (["parallel.pp=2", "toy.tie_word_embeddings=true"], r"toy.tie_word_embeddings: .* set it false"),
    (["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=8", "rollout.prompts_per_step=1"],
     r"parallel.microbatches: each of parallel.dp=2 ranks"),
])
def test_bad_pipeline_configs_fail_at_load(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny_cpu", overrides)


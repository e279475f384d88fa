"""Sharded data parallel (`parallel.fsdp`): FSDP2 over gloo against the single-process step.

Real gloo processes, the tiny float64 policy and draft of test_context_parallel, a fake
rollout (no vLLM). Two clipped AdamW updates of the policy and one draft update
(`draft_update`, as co-training runs it) through `ContextParallelPlan` with `shard_modules` must give LocalPlan's
losses, gradient norms, clipped gradients and updated weights (float64, 1e-10 relative);
the weights gathered for the engine equal the unsharded model's; a checkpoint written from
the shards resumes to the same next step. Checkpointed layers (ring attention at cp=2,
unsharded and sharded) give the plain step's gradients; the KL reference is sharded like the
policy. Last, `SpecTrainer.fit` at dp=2 with fsdp under Lightning (test_pp_fit's stand-in
engine, no vLLM), stopped and resumed, logs one process's metrics. gloo has every collective
FSDP2 needs here (all-gather, reduce-scatter with SUM).
"""
import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from spectrain.config import ConfigError, load_config
from spectrain.models.llama import apply_activation_checkpointing
from spectrain.parallel.cp.plan import ContextParallelPlan
from spectrain.parallel.fsdp import (
    full_tensor,
    gathered_optimizer_state,
    gathered_state_dict,
    is_sharded,
    shard_modules,
    shard_optimizer_state,
)
from spectrain.parallel.mesh import build_mesh
from spectrain.parallel.plan import LocalPlan, TapCollector
from spectrain.parallel.spawn import run_distributed
from spectrain.train.draft_update import draft_optimizer, draft_update
from tests.distributed.test_context_parallel import CAPTURE, PASS_DECAY, TTT_STEPS, _assert_close, _batch, _models
from tests.helpers import float64_grpo_loss_fn

LR, CLIP, UPDATES = 1e-2, 0.5, 2  # CLIP below the gradient norms: the global norm over shards scales every shard


def _full(named) -> dict[str, torch.Tensor]:
    """Whole tensors (collective for shards: every rank calls it in the same order)."""
    return {n: full_tensor(t, keep=True) for n, t in named}


def _optimizers(models):
    return torch.optim.AdamW(models.policy.parameters(), lr=LR), draft_optimizer(models.draft, LR)


def _train(plan, models, optimizers, reduce, micro_batch_tokens=None) -> dict:
    """`UPDATES` clipped policy updates, then one draft update on the last forward's taps."""
    policy_opt, draft_opt = optimizers
    batch = _batch()
    losses, norms = [], []
    for _ in range(UPDATES):
        policy_opt.zero_grad(set_to_none=True)
        taps = TapCollector(batch)
        result = plan.policy_forward_backward(models.policy, batch, float64_grpo_loss_fn(batch.num_response_tokens),
                                              CAPTURE, lambda loss: loss.backward(), taps, micro_batch_tokens)
        plan.reduce_gradients(models.policy)
        norms.append(plan.clip_grad_norm(models.policy, CLIP))
        policy_grads = _full((n, p.grad) for n, p in models.policy.named_parameters())
        policy_opt.step()
        losses.append(result.loss)
    update = draft_update(models.draft, draft_opt, taps.chunks, ttt_passes=TTT_STEPS, pass_decay=PASS_DECAY,
                          grad_clip=CLIP, sum_over_ranks=reduce, reduce_gradients=plan.reduce_gradients)
    assert update.applied
    return dict(policy_loss=torch.stack(losses), policy_grad_norm=torch.stack(norms), policy_grads=policy_grads,
                draft_loss=torch.tensor(update.loss, dtype=torch.float64),
                draft_grads=_full((n, p.grad) for n, p in models.draft.named_parameters()),
                policy=_full(models.policy.state_dict().items()), draft=_full(models.draft.state_dict().items()))


def _all_reduce(t):
    dist.all_reduce(t)
    return t


def _sharded(rank, dp, cp, seed=None):
    """Rank-dependent weights made rank 0's by `prepare`, then sharded."""
    models = _models(seed=rank if seed is None else seed)
    plan = ContextParallelPlan(build_mesh(1, dp, cp))
    plan.prepare(models)
    shard_modules(plan, models.policy, models.draft)
    assert is_sharded(models.policy) and is_sharded(models.draft)
    return plan, models


def _fsdp_worker(rank, world, dp, cp, micro_batch_tokens=None):
    plan, models = _sharded(rank, dp, cp)
    local = models.policy.model.layers["0"].mlp.up_proj.weight.to_local()
    assert local.shape[0] < models.policy.cfg.intermediate_size  # this rank holds a shard only
    synced = plan.policy_weights(models.policy), plan.draft_weights(models.draft)
    out = _train(plan, models, _optimizers(models), _all_reduce, micro_batch_tokens)
    return dict(out, synced_before=synced, synced_after=(plan.policy_weights(models.policy),
                                                         plan.draft_weights(models.draft)))


def _reference() -> tuple[dict, tuple]:
    models = _models(seed=0)
    local = LocalPlan()
    before = [[(n, t.clone()) for n, t in ws] for ws in (local.policy_weights(models.policy),
                                                          local.draft_weights(models.draft))]
    out = _train(local, models, _optimizers(models), reduce=lambda t: t)
    return out, (before, [local.policy_weights(models.policy), local.draft_weights(models.draft)])


def _assert_synced(got, want, what):
    """The engine's list: same names in the same order, equal tensors."""
    for got_ws, want_ws, which in zip(got, want, ("policy", "draft")):
        assert [n for n, _ in got_ws] == [n for n, _ in want_ws], f"{what} {which}: names differ"
        for (name, g), (_, w) in zip(got_ws, want_ws):
            assert g.device.type == "cpu" and not g.requires_grad, name
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what} {which} {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("dp,cp,micro_batch_tokens", [(2, 1, None), (2, 2, None), (2, 1, 1), (2, 1, 40)])
def test_fsdp_matches_local_plan(dp, cp, micro_batch_tokens):
    """Losses, gradient norms, clipped gradients and updated weights of the policy and the draft equal
    LocalPlan's, whole and in micro-batches (gradients accumulate into the shards); rank 0's sync lists equal
    the unsharded model's (before and after the updates)."""
    want, (synced_before, synced_after) = _reference()
    assert want["policy_grad_norm"].min() > CLIP and want["draft_loss"] > 0  # clipping on: the global norm matters
    for rank, got in enumerate(run_distributed(_fsdp_worker, dp * cp, dp, cp, micro_batch_tokens, timeout=300)):
        sync = got.pop("synced_before"), got.pop("synced_after")
        _assert_close(got, want, f"dp={dp} cp={cp} rank {rank}")
        if rank == 0:
            _assert_synced(sync[0], synced_before, "before")
            _assert_synced(sync[1], synced_after, "after")
        else:
            assert sync == ((None, None), (None, None)), f"rank {rank} kept gathered weights"


def _resume_worker(rank, world, path):
    """Train, checkpoint from the shards (rank 0 writes), train on; then a fresh run resumes from the file."""
    plan, models = _sharded(rank, world, 1)
    optimizers = _optimizers(models)
    _train(plan, models, optimizers, _all_reduce)
    keep = rank == 0
    saved = {"state_dict": gathered_state_dict(models, keep),
             "optimizer_states": [gathered_optimizer_state(opt, keep) for opt in optimizers]}
    if keep:
        torch.save(saved, path)
    dist.barrier()
    after = _train(plan, models, optimizers, _all_reduce)

    checkpoint = torch.load(path, weights_only=False)  # every rank reads the file, as Lightning does
    fresh = _models(seed=rank + 10)
    fresh.load_state_dict(checkpoint["state_dict"])  # before sharding, as Lightning restores the module
    plan = ContextParallelPlan(build_mesh(1, world, 1))
    plan.prepare(fresh)
    shard_modules(plan, fresh.policy, fresh.draft)
    resumed_opts = _optimizers(fresh)
    for opt, state in zip(resumed_opts, checkpoint["optimizer_states"]):
        opt.load_state_dict(state)
        shard_optimizer_state(opt)
    reloaded = [gathered_optimizer_state(opt, keep=True) for opt in resumed_opts]
    return dict(checkpoint=checkpoint, reloaded=reloaded, after=after,
                resumed=_train(plan, fresh, resumed_opts, _all_reduce))


@pytest.mark.slow
def test_checkpoint_from_shards_resumes_the_same_run(tmp_path):
    """The full state dict and AdamW state gathered from the shards (the unsharded format) load into a fresh
    sharded run whose next updates equal the uninterrupted run's."""
    for rank, got in enumerate(run_distributed(_resume_worker, 2, str(tmp_path / "last.ckpt"), timeout=300)):
        saved = got["checkpoint"]
        assert saved["state_dict"].keys() == _models(seed=0).state_dict().keys()
        for want, reloaded in zip(saved["optimizer_states"], got["reloaded"]):
            assert len(want["state"]) > 0 and want["param_groups"] == reloaded["param_groups"]
            _assert_close({str(i): s for i, s in reloaded["state"].items()},
                          {str(i): s for i, s in want["state"].items()}, f"rank {rank} optimizer state")
        _assert_close(got["resumed"], got["after"], f"rank {rank} resumed")


def _policy_step(plan, models) -> dict:
    """One policy forward/backward through `plan`: the step's loss and the full gradients."""
    batch = _batch()
    result = plan.policy_forward_backward(models.policy, batch, float64_grpo_loss_fn(batch.num_response_tokens),
                                          CAPTURE, lambda loss: loss.backward(), TapCollector(batch))
    plan.reduce_gradients(models.policy)
    return dict(loss=result.loss, grads=_full((n, p.grad) for n, p in models.policy.named_parameters()))


def _checkpointed_step(plan, models) -> dict:
    """`_policy_step` with every layer checkpointed, checking that each layer did run again in the backward."""
    apply_activation_checkpointing(models.policy, True)
    runs = []
    for layer in models.policy.model.layers.values():
        layer.mlp.register_forward_pre_hook(lambda *_: runs.append(1))
    out = _policy_step(plan, models)
    assert len(runs) == 2 * len(models.policy.model.layers), len(runs)
    return out


def _checkpointed_worker(rank, world):
    """Activation checkpointing at cp=2: the ring attention's collectives rerun in each layer's recompute; then
    the same under FSDP over the two cp ranks (each layer's weights gathered again for its recompute)."""
    models = _models(seed=rank)
    plan = ContextParallelPlan(build_mesh(1, 1, world))
    plan.prepare(models)
    ring = _checkpointed_step(plan, models)
    return dict(ring=ring, fsdp=_checkpointed_step(*_sharded(rank, 1, world)))


@pytest.mark.slow
def test_activation_checkpointing_under_ring_attention_and_fsdp():
    """Checkpointed layers at cp=2 (ring attention), unsharded and under FSDP: the loss and every gradient of
    LocalPlan's plain (not checkpointed) step, float64 to 1e-10."""
    want = _policy_step(LocalPlan(), _models(seed=0))
    for rank, got in enumerate(run_distributed(_checkpointed_worker, 2, timeout=300)):
        for name in ("ring", "fsdp"):
            _assert_close(got[name], want, f"{name} rank {rank}")


def _reference_worker(rank, world):
    """The KL reference deep-copied from the policy, as GRPOModule does, sharded by `shard_modules`."""
    models = _models(seed=rank)
    plan = ContextParallelPlan(build_mesh(1, world, 1))
    plan.prepare(models)
    models.reference = copy.deepcopy(models.policy).requires_grad_(False)
    unsharded = copy.deepcopy(models.reference)
    shard_modules(plan, models.policy, models.draft, models.reference)
    batch = _batch()
    args = batch.input_ids, batch.position_ids, batch.cu_seqlens
    with torch.no_grad():
        logits = unsharded(*args).logits
        dense = torch.log_softmax(logits, -1).gather(-1, batch.targets.clamp_min(0)[:, None]).squeeze(-1)
        models.reference.logprob_chunk_tokens = 7
        got = models.reference(*args, compute_logits=False, logprob_targets=batch.targets).logprobs
        got_dense = models.reference(*args).logits
    params = list(models.reference.parameters())
    return dict(want=torch.where(batch.targets >= 0, dense, 0.0), got=got, logits=logits, got_logits=got_dense,
                local=sum(p.to_local().numel() for p in params), total=sum(p.numel() for p in params),
                sharded=all(isinstance(p, DTensor) for p in params), frozen=not any(p.requires_grad for p in params),
                root_resharded=isinstance(models.reference.lm_head.weight, DTensor))


@pytest.mark.slow
def test_the_kl_reference_is_sharded_like_the_policy():
    """At dp=2 each rank holds half of the reference's elements, frozen; its logprobs (chunked lm_head) and
    logits equal the unsharded copy's, and after a forward its root (embeddings, lm_head) is sharded again."""
    for rank, got in enumerate(run_distributed(_reference_worker, 2, timeout=300)):
        assert got["sharded"] and got["frozen"] and got["root_resharded"], rank
        assert 2 * got["local"] == got["total"], (rank, got["local"], got["total"])
        torch.testing.assert_close(got["got"], got["want"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["got_logits"], got["logits"], rtol=1e-12, atol=1e-12)


def test_fsdp_config_errors_name_the_keys():
    load_config(overrides=["parallel.dp=2", "parallel.fsdp=true"])
    load_config(overrides=["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2", "parallel.fsdp=true"])
    with pytest.raises(ConfigError, match=r"parallel.fsdp: .*nothing to shard over; raise parallel.dp"):
        load_config(overrides=["parallel.fsdp=true"])


# ---------------------------------------------------------------------------------- SpecTrainer.fit
LOGPROB_DIFF_ATOL = 5e-8
RESUME_AT = 2  # the first fit stops here (a checkpoint per step); the same command with one more step resumes


def _fit_and_resume(run_dir, overrides, warmstart_dir):
    """Two fits in one run directory: up to RESUME_AT, then resumed for the last step (checkpoints every step)."""
    from tests.distributed.test_pp_fit import STEPS, _fit

    for steps in (RESUME_AT, STEPS):
        _fit(run_dir, [*overrides, "trainer.checkpoint_every_n_steps=1", f"trainer.max_steps={steps}"], warmstart_dir)


def _fit_worker(rank, world, tmp_path):
    """One rank, launched as torchrun would (its environment; the process group is up)."""
    os.environ.update(TORCHELASTIC_RUN_ID="test", RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    _fit_and_resume(tmp_path / "fsdp", ["parallel.dp=2", "parallel.fsdp=true"], tmp_path / f"warmstart_fsdp_{rank}")


@pytest.mark.slow
def test_fit_dp2_fsdp_checkpoints_and_resumes_like_one_process(tmp_path):
    """`SpecTrainer.fit` (Lightning, the spec_parallel strategy, DraftCoTraining, WeightSync, ModelCheckpoint) with
    parallel.dp=2 parallel.fsdp=true, stopped after RESUME_AT steps and resumed from its checkpoint, logs what
    one process logs on the same stop and resume; its checkpoint and final export hold the same weights."""
    from safetensors.torch import load_file

    from tests.distributed.test_pp_fit import ATOL, RTOL, STEPS, _compared_columns, _step_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fit_and_resume(tmp_path / "one", [], tmp_path / "warmstart_one")
    finally:
        torch.set_num_threads(threads)
    run_distributed(_fit_worker, 2, tmp_path, timeout=600)
    want, got = _step_rows(tmp_path / "one"), _step_rows(tmp_path / "fsdp")
    columns = _compared_columns(want[0])
    assert _compared_columns(got[0]) == columns and {"draft/loss", "policy/grad_norm"} <= set(columns)
    for step, (a, b) in enumerate(zip(want, got)):
        for col in columns:
            x, y = float(a[col]), float(b[col])
            # engine_logprob_diff is itself float32 rounding (~8e-8 per token): FSDP's float32 logprobs round
            # otherwise after the resume (measured 1.7e-8 apart at step 3; the loss 1.4e-7 relative)
            atol = LOGPROB_DIFF_ATOL if col == "policy/engine_logprob_diff" else ATOL
            assert abs(x - y) <= RTOL * abs(x) + atol, f"step {step} {col}: one process {x} vs fsdp {y}"
    ckpts = [torch.load(tmp_path / name / "checkpoints/last.ckpt", weights_only=False) for name in ("one", "fsdp")]
    assert ckpts[1]["state_dict"].keys() == ckpts[0]["state_dict"].keys() and ckpts[1]["global_step"] == STEPS
    for key, want_t in ckpts[0]["state_dict"].items():  # float32 weights: measured <= 1.2e-7 apart (summation order)
        torch.testing.assert_close(ckpts[1]["state_dict"][key], want_t, rtol=1e-5, atol=1e-6, msg=key)
    draft_optimizers = [c["draft"]["optimizer"] for c in ckpts]  # the draft owner's, full size
    assert len(ckpts[1]["optimizer_states"]) == 1 and draft_optimizers[0]["state"]
    for want_opt, got_opt in zip([*ckpts[0]["optimizer_states"], draft_optimizers[0]],
                                 [*ckpts[1]["optimizer_states"], draft_optimizers[1]]):
        assert got_opt["state"].keys() == want_opt["state"].keys() and not any(
            type(t).__name__ == "DTensor" for s in got_opt["state"].values() for t in s.values())
    exported = load_file(tmp_path / "fsdp/final/policy/model.safetensors")
    for name, t in exported.items():
        torch.testing.assert_close(t, ckpts[1]["state_dict"][f"policy.{name}"].to(t.dtype), rtol=0, atol=0, msg=name)

"""Context parallel end to end: the dp x cp plan against LocalPlan, `spectrain fit` at cp=2
against cp=1, and the bad inputs (cp not dividing the world, padded documents too long, an
attention backend without CP support).

Plan checks run in real gloo processes on a tiny float64 policy and draft with a fake
rollout (no vLLM): loss, policy gradients, draft loss, draft metrics and draft gradients
must equal the single-process ones to 1e-10.
"""
import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spectrain.config import ConfigError, load_config
from spectrain.ops.attention import LocalAttentionOps
from spectrain.parallel.cp.plan import ContextParallelPlan, check_cp_attention_ops, dp_documents
from spectrain.parallel.cp.ring import ZigzagRingAttentionOps
from spectrain.parallel.mesh import build_mesh, check_mesh_shape
from spectrain.parallel.plan import LocalPlan, TapCollector
from spectrain.parallel.spawn import run_distributed
from spectrain.train.draft_update import draft_loss
from tests.helpers import StandInModule, float64_grpo_loss_fn, mixed_length_batch

ROOT = Path(__file__).resolve().parents[2]
POLICY = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
CAPTURE = (1, 2, 3)
TTT_STEPS, PASS_DECAY = 3, 0.8
TOL = dict(rtol=1e-10, atol=1e-12)


def _models(seed: int) -> StandInModule:
    return StandInModule(POLICY, CAPTURE, seed)


def _batch():
    """Six documents of mixed lengths (one shorter than 2*cp chunks)."""
    return mixed_length_batch([(4, 9), (6, 1), (3, 22), (5, 12), (2, 2), (7, 17)], POLICY["vocab_size"])


def _step(plan, models, batch, reduce, micro_batch_tokens=None):
    """One policy + draft step through `plan`; everything the step produces, summed over ranks."""
    taps = TapCollector(batch)
    result = plan.policy_forward_backward(models.policy, batch, float64_grpo_loss_fn(batch.num_response_tokens),
                                          CAPTURE, lambda loss: loss.backward(), taps, micro_batch_tokens)
    plan.reduce_gradients(models.policy)
    models.draft_inputs = taps.chunks
    loss, metrics = draft_loss(models.draft, models.draft_inputs, TTT_STEPS, PASS_DECAY)
    loss.backward()
    plan.reduce_gradients(models.draft)
    return dict(
        policy_loss=result.loss,
        draft_loss=reduce(loss.detach().clone()),
        draft_metrics=reduce(torch.stack([metrics.loss_sum, metrics.correct.double(), metrics.count.double()])),
        policy_grads={n: p.grad for n, p in models.policy.named_parameters()},
        draft_grads={n: p.grad for n, p in models.draft.named_parameters()},
    )


def _plan_worker(rank, world, dp, cp, micro_batch_tokens=None):
    models = _models(seed=rank)  # different weights per rank: prepare() must make them rank 0's
    plan = ContextParallelPlan(build_mesh(1, dp, cp))
    plan.prepare(models)
    assert plan.hosts_draft and plan.is_rollout_rank == (rank == 0)
    assert plan.share({"from": rank}) == {"from": 0}
    assert (plan.policy_weights(models.policy) is None) == (rank != 0)

    def reduce(t):
        dist.all_reduce(t)
        return t

    return _step(plan, models, _batch(), reduce, micro_batch_tokens)


def _reference(micro_batch_tokens=None):
    models = _models(seed=0)
    return _step(LocalPlan(), models, _batch(), lambda t: t, micro_batch_tokens)


def _assert_close(got, want, what):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for k in want:
            _assert_close(got[k], want[k], f"{what}.{k}")
    else:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


# the batch's documents are 13, 7, 25, 17, 4 and 24 tokens long: a budget of 1 runs each alone (a document is never
# split), 40 packs [13, 7], [25], [17, 4], [24]
BUDGETS = [1, 40]


@pytest.mark.parametrize("micro_batch_tokens", BUDGETS)
def test_micro_batches_reproduce_the_whole_batch_step(micro_batch_tokens):
    """One process: policy loss and gradients, draft loss, metrics and gradients of a micro-batched step equal the
    one-forward step's (float64), and the logprobs come back in the batch's order."""
    want, got = _reference(), _reference(micro_batch_tokens)
    _assert_close(got, want, f"micro_batch_tokens={micro_batch_tokens}")
    batch, policy = _batch(), _models(seed=0).policy
    whole, parts = (LocalPlan().policy_forward_backward(policy, batch, float64_grpo_loss_fn(batch.num_response_tokens),
                                                        (), lambda loss: None, None, budget)
                    for budget in (None, micro_batch_tokens))
    torch.testing.assert_close(parts.logprobs, whole.logprobs, **TOL)
    assert torch.equal(parts.batch.input_ids, batch.input_ids) and torch.equal(parts.batch.cu_seqlens, batch.cu_seqlens)


@pytest.mark.slow
@pytest.mark.parametrize("dp,cp,micro_batch_tokens", [(1, 2, None), (2, 1, None), (2, 2, None), (2, 2, 1)])
def test_plan_matches_local_plan(dp, cp, micro_batch_tokens):
    """Policy loss and gradients, draft loss, metrics and gradients equal LocalPlan's (float64), whole and in
    micro-batches (the budget is per rank; 1 token is the extreme: every document in its own micro-batch)."""
    want = _reference()
    assert want["draft_metrics"][2, 0] > 0 and want["policy_loss"] != 0
    for rank, got in enumerate(run_distributed(_plan_worker, dp * cp, dp, cp, micro_batch_tokens, timeout=240)):
        _assert_close(got, want, f"dp={dp} cp={cp} micro_batch_tokens={micro_batch_tokens} rank {rank}")


# ---------------------------------------------------------------------------------- bad input
def test_cp_not_dividing_the_world_names_the_fix(monkeypatch):
    with pytest.raises(ValueError, match=r"3 does not divide 4"):
        check_mesh_shape(1, 1, 3, 4)
    with pytest.raises(ValueError, match=r"set parallel.dp=2"):
        check_mesh_shape(1, 1, 2, 4)
    with pytest.raises(ValueError, match=r"parallel.cp=0"):
        check_mesh_shape(1, 1, 0, 1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"Launch 2 processes .*--nproc-per-node 2"):
        build_mesh(1, 1, 2)  # one process, no torchrun
    from spectrain.parallel.strategy import SpecParallelStrategy

    with pytest.raises(ValueError, match=r"Launch 2 processes"):  # before any rendezvous is attempted
        SpecParallelStrategy(load_config(overrides=["parallel.cp=2"]).parallel).setup_distributed()
    assert not dist.is_initialized()


def test_padded_documents_longer_than_the_positions_fail_before_work(tmp_path):
    from spectrain.train.trainer import SpecTrainer

    def trainer(*overrides):
        t = SpecTrainer(load_config(overrides=[f"trainer.run_dir={tmp_path}", *overrides]))
        t.tokenizer, t.source = t.build_tokenizer(), t.prompts()
        return t

    t = trainer()
    longest = max(len(t.tokenizer.encode(ex.prompt)) for ex in t.eval_examples())  # as check_lengths sees them
    new = 17 - longest % 16  # longest + new = 1 (mod 16): cp=8 pads it by 15 tokens
    fits = longest + new + 4  # + the speculative lookahead: the engine's bound holds exactly
    ok = [f"rollout.response_length={new}", f"rollout.max_model_len={fits}", f"toy.max_position_embeddings={fits}"]
    trainer(*ok, "parallel.cp=2").check_lengths()  # 1 (mod 16) pads by 3 at cp=2
    with pytest.raises(ConfigError, match=r"toy.max_position_embeddings: .* parallel.cp=8: .* multiple of 2\*cp"):
        trainer(*ok, "parallel.cp=8").check_lengths()
    with pytest.raises(ValueError, match="cannot be split over parallel.dp=4"):
        dp_documents(3, 4, 0)
    assert dp_documents(7, 2, 0) == [0, 1, 2, 3] and dp_documents(7, 2, 1) == [4, 5, 6]


def test_attention_backend_without_cp_support_fails_before_work():
    check_cp_attention_ops(LocalAttentionOps())

    class CausalOnly(LocalAttentionOps):
        supports_context_parallel = False

    class ForwardOnly:
        def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale=None): ...

    with pytest.raises(TypeError, match=r"CausalOnly: it declares supports_context_parallel = False.*parallel.cp=1"):
        check_cp_attention_ops(CausalOnly())
    with pytest.raises(TypeError, match=r"ForwardOnly: it has no .*backward"):
        check_cp_attention_ops(ForwardOnly())
    with pytest.raises(TypeError, match="already ring attention"):
        check_cp_attention_ops(ZigzagRingAttentionOps.__new__(ZigzagRingAttentionOps))


# ---------------------------------------------------------------------------------- spectrain fit
FIT = ["trainer.max_steps=2", "sft.steps=30", "draft.warmup_steps=10", "rollout.prompts_per_step=4",
       "rollout.n=4", "eval.every_n_steps=0", "reward.partial_credit=0.5", "sync.check_alive=false",
       "trainer.progress_bar=false", "trainer.checkpoint_every_n_steps=1000"]
FIT_COLUMNS = ("policy/loss", "policy/grad_norm", "draft/loss", "draft/pass_1_loss", "draft/pass_3_loss")
FIT_RTOL, FIT_ATOL = 1e-4, 1e-6  # float32; measured ~2e-6 relative (ring merges, summed shards)


def _fit(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "spectrain.cli", "fit", "tiny_cpu", *FIT, *overrides,
           f"trainer.run_dir={tmp_path / name}", f"trainer.warmstart_dir={tmp_path / 'warmstart'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(tmp_path / name / "logs" / "version_0" / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("policy/loss")]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(3000)
def test_fit_cp2_reproduces_one_process_losses(tmp_path):
    """`spectrain fit ... parallel.cp=2` (relaunched under torchrun, a vLLM engine on each rank serving half of
    the prompts) logs the one-process losses of the first steps: the rollout is the same (the same per-request
    seeds, whichever engine serves a prompt) and the step is split in zigzag shards. (FSDP's fit against one
    process: tests/distributed/test_fsdp.py; dp=2 with real engines: tests/distributed/test_launchers.py.)"""
    one = _fit(tmp_path, "cp1")  # fills the shared warm-start cache
    assert all(float(r["policy/grad_norm"]) > 0 for r in one), "no policy gradient: the check would be vacuous"
    other = _fit(tmp_path, "cp2", "parallel.cp=2")
    assert len(one) == len(other) == 2
    for step, (a, b) in enumerate(zip(one, other)):
        for col in FIT_COLUMNS:
            x, y = float(a[col]), float(b[col])
            assert abs(x - y) <= FIT_RTOL * abs(x) + FIT_ATOL, f"step {step} {col}: one process {x} vs cp2 {y}"
        assert float(b["policy/engine_logprob_diff"]) < 1e-5 and float(b["sync/mismatches"]) == 0, b


# ---------------------------------------------------------------------------------- bench baselines
def test_bench_dense_baseline_is_ttt_attention():
    """`spectrain bench cp`'s dense-mask baseline computes what `ttt_attention` computes."""
    from benchmarks.cp import HKV, HQ, D, dense_ttt_attention, staircase_mask
    from spectrain.ops.ttt_attention import ttt_attention

    cu = torch.tensor([0, 5, 17, 30], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(30, HQ, D, generator=g, dtype=torch.float64)
    keys = [torch.randn(30, HKV, D, generator=g, dtype=torch.float64) for _ in range(3)]
    values = [torch.randn(30, HKV, D, generator=g, dtype=torch.float64) for _ in range(3)]
    mask = staircase_mask(cu, 3)
    assert mask.shape == (30, 90) and mask[6, 5:7].tolist() == [True, True] and not mask[6, 4] and mask[6, 36]
    torch.testing.assert_close(dense_ttt_attention(q, keys, values, cu), ttt_attention(q, keys, values, cu),
                               rtol=1e-10, atol=1e-10)


def _allgather_worker(rank, world):
    from benchmarks.cp import AllGatherKVOps
    from spectrain.parallel.cp.zigzag import ZigzagLayout

    lay = ZigzagLayout.build(torch.tensor([0, 5, 42, 106, 124], dtype=torch.int32), world, rank)
    cu, n = lay.cu_seqlens_local, lay.num_local_tokens
    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(n, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    out = {}
    group = dist.group.WORLD
    for name, ops in (("ring", ZigzagRingAttentionOps(group)), ("allgather", AllGatherKVOps(group))):
        o, lse = ops.forward(q, k, v, cu, cu, True)
        out[name] = (o, lse, *ops.backward(dout, q, k, v, o, lse, cu, cu, True))
    return out


@pytest.mark.slow
def test_bench_allgather_baseline_matches_ring():
    for rank, res in enumerate(run_distributed(_allgather_worker, 2, timeout=120)):
        for got, want in zip(res["allgather"], res["ring"]):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank}: {m}")

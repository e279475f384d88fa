"""The policy's lm_head in chunks of tokens (`spectrain.ops.chunked_logprobs`): per-token logprobs and their
gradients, and the draft's teacher, equal the dense `[T, V]` path, and no `[T, V]` tensor is kept for the backward."""
import pytest
import torch
import torch.nn.functional as F

from spectrain.models.eagle3 import ttt_loss
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM
from spectrain.ops.chunked_logprobs import teacher_on_draft_vocab, token_logprobs
from spectrain.train import grpo
from tests.helpers import cu_of, mixed_length_batch
from tests.unit.test_draft_loss import LENGTHS, copy_shift

TOL64 = dict(atol=1e-10, rtol=1e-10)
T, H, V = 23, 12, 37  # V equals no other size: a saved tensor with V columns would be logits


def inputs(dtype=torch.float64, seed: int = 0):
    """Hidden states, an lm_head, targets with some -1 (no target) and an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * H**-0.5 * 3
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[torch.rand(T, generator=gen) < 0.3] = -1
    grad = torch.randn(T, generator=gen, dtype=torch.float64)
    hidden, weight = (x.to(dtype).requires_grad_() for x in (hidden, weight))
    return hidden, weight, targets, grad


def dense_logprobs(hidden, weight, targets):
    """The reference: whole logits, their log-softmax gathered at the targets, 0 where there is none."""
    logp = torch.log_softmax(F.linear(hidden, weight).to(torch.promote_types(hidden.dtype, torch.float32)), -1)
    return torch.where(targets >= 0, logp.gather(-1, targets.clamp_min(0)[:, None]).squeeze(-1), 0.0)


def value_and_grads(fn, hidden, weight, targets, grad):
    out = fn(hidden, weight, targets)
    return out.detach(), torch.autograd.grad((out * grad.to(out.dtype)).sum(), (hidden, weight))


@pytest.mark.parametrize("chunk", [1, 4, 7, T, 100], ids=lambda c: f"chunk{c}")
def test_logprobs_and_gradients_equal_the_dense_path_in_float64(chunk):
    """Chunks that divide T (1, T), that do not (4, 7) and one larger than T."""
    hidden, weight, targets, grad = inputs()
    got, (g_hidden, g_weight) = value_and_grads(lambda h, w, t: token_logprobs(h, w, t, chunk), hidden, weight,
                                                targets, grad)
    want, (w_hidden, w_weight) = value_and_grads(dense_logprobs, hidden, weight, targets, grad)
    assert got.dtype == torch.float64 and got[targets < 0].eq(0).all() and got[targets >= 0].lt(0).all()
    torch.testing.assert_close(got, want, **TOL64)
    torch.testing.assert_close(g_hidden, w_hidden, **TOL64)
    torch.testing.assert_close(g_weight, w_weight, **TOL64)
    assert g_hidden[targets < 0].eq(0).all()


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-inputs", "fp32-under-bf16-autocast"])
def test_bf16_agrees_with_the_dense_bf16_path(autocast):
    """bf16 weights (FSDP's mixed precision), or float32 ones under bf16 autocast (Lightning's bf16-mixed): the
    matmul runs in bf16 in both paths and the log-softmax in float32; logprobs are float32 and gradients come back
    in the inputs' dtypes. Tolerances: logprobs within 1e-5 (the same bf16 logits; only the log-sum-exp's
    summation order differs: measured <= 1e-6); gradients within 1e-2 relative Frobenius error (measured: the
    hidden-state gradient bit-equal, the lm_head's <= 0.4% apart, because it adds per-chunk bf16 products in
    float32 where the dense path rounds one whole-batch product; each is ~0.4% from the float64 truth)."""
    hidden, weight, targets, grad = inputs(torch.float32 if autocast else torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, got_g = value_and_grads(lambda h, w, t: token_logprobs(h, w, t, 5), hidden, weight, targets, grad)
        want, want_g = value_and_grads(lambda h, w, t: torch.where(t >= 0, grpo.token_logprobs(F.linear(h, w), t), 0.0),
                                       hidden, weight, targets, grad)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w, x in zip(got_g, want_g, (hidden, weight)):
        assert g.dtype == x.dtype
        assert ((g.double() - w.double()).norm() / w.double().norm()).item() < 1e-2


def saved_shapes(run) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves for the backward while `run()` builds the graph."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return shapes


def test_the_forward_keeps_no_logits_for_the_backward():
    """Saved: the inputs, the targets and one log-sum-exp per row; nothing with V columns (the dense path keeps
    the [T, V] logits' log-softmax)."""
    hidden, weight, targets, _ = inputs()
    assert saved_shapes(lambda: token_logprobs(hidden, weight, targets, 4)) == [(T, H), (V, H), (T,), (T,)]
    assert (T, V) in saved_shapes(lambda: dense_logprobs(hidden, weight, targets))


def test_the_teacher_equals_the_dense_one():
    hidden, weight, _, _ = inputs()
    t2d = torch.rand(V, generator=torch.Generator().manual_seed(5)) < 0.5
    logprobs, top1 = teacher_on_draft_vocab(hidden, weight, t2d, chunk_tokens=4)
    logits = hidden.detach() @ weight.detach().T
    assert not logprobs.requires_grad and logprobs.shape == (T, int(t2d.sum())) and top1.dtype == torch.int64
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[:, t2d], atol=1e-12, rtol=1e-12)
    assert torch.equal(top1, logits.argmax(-1))


@pytest.mark.parametrize("shift_fn", [None, copy_shift], ids=["by-row", "shifted-copies"])
@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_ttt_loss_on_the_restricted_teacher_equals_it_on_the_full_logits(impl, shift_fn):
    """`ttt_loss(..., teacher_top1=)` on `teacher_on_draft_vocab`'s output: the loss, metrics and draft gradients of
    the `[T, V]` teacher logits (softmax over the draft vocabulary does not see the full vocabulary's log-sum-exp)."""
    gen = torch.Generator().manual_seed(2)
    t, h, vocab = sum(LENGTHS), 8, 30
    policy_hidden = torch.randn(t, h, generator=gen, dtype=torch.float64)
    policy_head = 2 * torch.randn(vocab, h, generator=gen, dtype=torch.float64)
    t2d = torch.rand(vocab, generator=gen) < 0.6
    noise = lambda *shape: 0.3 * torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    # a draft close to the policy, so that its top-1 often agrees (pass d at row i predicts the policy at i + d)
    weight = (policy_head[t2d] + noise(int(t2d.sum()), h)).requires_grad_()
    hidden = [(policy_hidden.roll(-d, 0) + noise(t, h)).requires_grad_() for d in range(1, 4)]
    mask, cu = torch.rand(t, generator=gen) < 0.75, cu_of(LENGTHS)
    kwargs = dict(pass_decay=0.7, shift_fn=shift_fn, **(dict(lm_head=weight, loss_kernel="chunked", chunk=4)
                                                       if impl == "chunked" else {}))
    restricted, top1 = teacher_on_draft_vocab(policy_hidden, policy_head, t2d, chunk_tokens=5)
    results = []
    for teacher, extra in ((policy_hidden @ policy_head.T, {}), (restricted, dict(teacher_top1=top1))):
        drafts = hidden if impl == "chunked" else [x @ weight.T for x in hidden]
        loss, metrics = ttt_loss(drafts, teacher, mask, cu, t2d, **kwargs, **extra)
        results.append((loss, metrics, torch.autograd.grad(loss, [*hidden, weight])))
    (want, want_m, want_g), (got, got_m, got_g) = results
    torch.testing.assert_close(got, want, **TOL64)
    torch.testing.assert_close(got_m.loss_sum, want_m.loss_sum, **TOL64)
    assert torch.equal(got_m.correct, want_m.correct) and torch.equal(got_m.count, want_m.count)
    assert want_m.correct.sum() > 0
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, **TOL64)


def test_the_policy_forward_gives_logprobs_and_teacher_without_logits():
    """`LlamaForCausalLM.forward(logprob_targets=, teacher_t2d=, compute_logits=False)`: the logprobs and every
    parameter gradient of the dense path, the same teacher, and no saved tensor with V columns."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)).double()
    batch = mixed_length_batch([(3, 5), (6, 2), (2, 7)], V)
    args = batch.input_ids, batch.position_ids, batch.cu_seqlens
    t2d = torch.rand(V, generator=torch.Generator().manual_seed(1)) < 0.5
    params = list(policy.parameters())
    dense = policy(*args)
    want = dense_logprobs(dense.hidden, policy.lm_head.weight, batch.targets)
    want_grads = torch.autograd.grad(want.sum(), params)
    policy.logprob_chunk_tokens = 4
    out = policy(*args, compute_logits=False, logprob_targets=batch.targets, teacher_t2d=t2d)
    assert out.logits is None
    torch.testing.assert_close(out.logprobs, want, **TOL64)
    for g, w in zip(torch.autograd.grad(out.logprobs.sum(), params), want_grads):
        torch.testing.assert_close(g, w, **TOL64)
    torch.testing.assert_close(out.teacher[0], torch.log_softmax(dense.logits, -1)[:, t2d].detach(), **TOL64)
    assert torch.equal(out.teacher[1], dense.logits.argmax(-1))
    shapes = saved_shapes(lambda: policy(*args, compute_logits=False, logprob_targets=batch.targets))
    assert batch.input_ids.shape[0] != V and all(s[-1:] != (V,) for s in shapes), shapes

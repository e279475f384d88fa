"""`policy.activation_checkpointing`: each decoder layer recomputed in the backward gives the plain loss, taps and
every parameter gradient (float64, bit for bit), keeps less for the backward, and runs each layer twice."""
import pytest
import torch

from spectrain.models.llama import LlamaConfig, LlamaForCausalLM, apply_activation_checkpointing
from spectrain.parallel.plan import draft_inputs_from, ttt_valid_tokens
from tests.helpers import float64_grpo_loss_fn, mixed_length_batch
from tests.unit.test_draft_loss import saved_teacher_bytes

TAPS = (0, 2, 3)
POLICY = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def policy(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**POLICY, **overrides})).double()
    with torch.no_grad():  # O(1) weights, so every term of the gradients matters
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model


def batch():
    return mixed_length_batch([(3, 5), (6, 2), (2, 7), (4, 4)], POLICY["vocab_size"])


def step(model, b, checkpointed: bool):
    """GRPO loss over a packed multi-document batch with the draft's taps captured: loss, taps, gradients."""
    apply_activation_checkpointing(model, checkpointed)
    model.zero_grad(set_to_none=True)
    out = model(b.input_ids, b.position_ids, b.cu_seqlens, tap_layers=TAPS, logprob_targets=b.targets)
    loss, _ = float64_grpo_loss_fn(b.num_response_tokens)(out.logprobs, b)
    loss.backward()
    return loss.detach(), out, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", [{}, {"qk_norm": True, "tie_word_embeddings": True}], ids=["llama", "qwen3-tied"])
def test_checkpointed_layers_give_the_plain_loss_taps_and_gradients(variant):
    model, b = policy(**variant), batch()
    want_loss, want_out, want_grads = step(model, b, checkpointed=False)
    loss, out, grads = step(model, b, checkpointed=True)
    assert torch.equal(loss, want_loss) and want_loss != 0
    for got, want in zip(out.tap_hidden, want_out.tap_hidden):  # the residual entering each captured layer
        assert torch.equal(got, want)
    assert torch.equal(out.tap_hidden[0], out.embeds)
    draft = draft_inputs_from(out, b, model.attention_ops, None, ttt_valid_tokens(b))
    assert not any(t.requires_grad for t in (*draft.tap_hidden, draft.embeds, draft.teacher_logits))
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, want_grads[name]), name


def test_each_layer_runs_again_in_the_backward_and_keeps_less():
    """One extra forward per layer (counted as its MLP starts: the recompute stops once the last saved tensor is
    back, inside the MLP); autograd keeps far less outside the layers' inputs."""
    model, b = policy(), batch()
    calls = []
    for idx, layer in model.model.layers.items():
        layer.mlp.register_forward_pre_hook(lambda *_, idx=idx: calls.append(idx))

    def run(checkpointed: bool) -> int:
        calls.clear()
        return saved_teacher_bytes(lambda: step(model, b, checkpointed))

    plain = run(False)
    assert calls == ["0", "1", "2", "3"]
    checkpointed = run(True)
    assert calls == ["0", "1", "2", "3", "3", "2", "1", "0"]
    assert checkpointed < plain / 2, (checkpointed, plain)


def test_no_recompute_without_gradients():
    model, b = policy(), batch()
    apply_activation_checkpointing(model, True)
    with torch.no_grad():
        logits = model(b.input_ids, b.position_ids, b.cu_seqlens).logits
    apply_activation_checkpointing(model, False)
    with torch.no_grad():
        assert torch.equal(logits, model(b.input_ids, b.position_ids, b.cu_seqlens).logits)

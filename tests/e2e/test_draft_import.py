"""An EAGLE-3 draft brought from disk in SpecForge's layout (no eagle_config, a draft vocabulary
smaller than the policy's with d2t/t2d, the target's embedding copied in): `load_draft` reads it,
`export_draft` writes it for vLLM, and vLLM speculates with it losslessly."""
import pytest
import torch

from spectrain.batch import build_rollout_batch
from spectrain.models.eagle3 import export_draft, load_draft
from spectrain.models.hf_io import save_pretrained
from spectrain.parallel.plan import draft_inputs_from, ttt_valid_tokens
from spectrain.rollout.engine import Completion, SamplingConfig
from spectrain.rollout.vllm.engine import VLLMRolloutEngine
from spectrain.tasks.draft_vocab import vocab_mapping_from_token_ids
from spectrain.tasks.hf_tiny import write_specforge_draft
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train.draft_update import draft_update
from tests.e2e.test_engine import greedy_decode
from tests.helpers import tiny_policy

K = 2  # num_speculative_tokens
DRAFT_VOCAB = 40  # of the policy's 83
MAX_TOKENS = 24
EOS = CharTokenizer().eos_id  # the engine decodes past it (fixed-length runs), the trainer's greedy text does not
PROMPTS = ["12+34=", "7+8=", "99-3=", "hello", "5*6=", "40+2="]


def _train(draft, policy, prompts, continuations, steps: int = 50) -> float:
    """TTT on the policy's own greedy text, as the draft warm-up does; returns the last pass-1 top-1."""
    batch = build_rollout_batch([Completion(i, p, c, [0.0] * len(c), False)
                                 for i, (p, c) in enumerate(zip(prompts, continuations))], torch.zeros(len(prompts)))
    with torch.no_grad():
        out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=draft.cfg.tap_layers)
    taps = draft_inputs_from(out, batch, policy.attention_ops, None, ttt_valid_tokens(batch))
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(steps):
        update = draft_update(draft, opt, [taps], ttt_passes=K, pass_decay=0.8, grad_clip=1.0)
    return update.metrics.accuracy[0].item()


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("draft_import")
    tok, policy = CharTokenizer(), tiny_policy().eval()
    save_pretrained(policy, root / "policy", tokenizer=tok)
    prompts = [tok.encode(p) for p in PROMPTS]
    continuations = [greedy_decode(policy, p, MAX_TOKENS) for p in prompts]
    d2t, t2d = vocab_mapping_from_token_ids(continuations, tok.vocab_size, DRAFT_VOCAB, always_include=[EOS])
    write_specforge_draft(root / "specforge", root / "policy", d2t, t2d, seed=0)
    with pytest.warns(UserWarning, match=r"default aux layers \(1, 2, 3\)"):
        draft = load_draft(root / "specforge", policy_cfg=policy.cfg,
                           policy_embeddings=policy.model.embed_tokens.weight)
    assert (draft.cfg.draft_vocab_size, torch.equal(draft.t2d, t2d)) == (DRAFT_VOCAB, True)
    top1 = _train(draft, policy, prompts, continuations)
    assert top1 > 0.5, top1
    # a per-batch-size schedule, so that the same engine can also decode without the draft (k=0)
    engine = VLLMRolloutEngine(root / "policy", export_draft(draft, root / "draft", policy.cfg),
                               num_speculative_tokens=K, spec_schedule=[(1, 1, K)], max_model_len=128, kv_cache_gib=1)
    engine.set_num_speculative_tokens(K)
    yield engine, prompts, continuations
    engine.shutdown()


def _greedy(engine, prompts):
    """Token ids and the spec-decode counters it moved; fixed length (no EOS) so runs compare exactly."""
    before = engine.spec_decode_counters()
    out = engine.generate(prompts, SamplingConfig(n=1, max_tokens=MAX_TOKENS, temperature=0.0, min_tokens=MAX_TOKENS))
    return [c.token_ids for c in out], engine.spec_decode_counters() - before


@pytest.mark.vllm
@pytest.mark.slow
def test_specforge_draft_speculates_losslessly_in_vllm(world):
    engine, prompts, continuations = world
    speculated, spec = _greedy(engine, prompts)
    engine.set_num_speculative_tokens(0)
    plain, none = _greedy(engine, prompts)
    assert none.num_drafts == 0 and spec.num_drafts > 0
    assert speculated == plain
    for out, trainer in zip(plain, continuations):  # and it is the policy's greedy text, up to an EOS
        cut = trainer.index(EOS) if EOS in trainer else MAX_TOKENS
        assert out[:cut] == trainer[:cut]
    assert spec.num_accepted_tokens > 0.1 * spec.num_draft_tokens, spec  # observed 54 of 172

"""EAGLE-3 draft: vLLM naming, vocab mapping, the TTT unroll against a dense reference,
the loss, export/import, and (slow) the exported draft speculating inside vLLM."""
import json
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# vLLM reads these at import: the engine in this process, a small KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from spectrain.errors import ConfigError  # noqa: E402
from spectrain.models.eagle3 import (  # noqa: E402
    Eagle3Config,
    Eagle3Draft,
    build_vocab_mapping,
    draft_sync_weights,
    export_draft,
    load_draft,
    shift_within_docs,
    ttt_loss,
)
from spectrain.models.hf_io import save_pretrained  # noqa: E402
from spectrain.models.llama import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    apply_rope,
    pack_sequences,
    rope_cos_sin,
)
from spectrain.tasks.draft_vocab import vocab_mapping_from_token_ids  # noqa: E402
from spectrain.tasks.hf_tiny import write_specforge_draft  # noqa: E402

# The policy the vLLM tests run: head_dim 32 (vLLM-CPU attention rejects 16).
POLICY = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2)
SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)


def _small_draft(draft_vocab_size: int = 20, seed: int = 0) -> Eagle3Draft:
    """float64 draft with O(1) weights and a non-trivial vocab mapping, for exact checks."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(Eagle3Config.from_policy(LlamaConfig(**SMALL), draft_vocab_size=draft_vocab_size)).double()
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.4 + (1.0 if p.dim() == 1 else 0.0))
    draft.set_vocab_mapping(*build_vocab_mapping(torch.rand(SMALL["vocab_size"]), draft_vocab_size))
    return draft


# ---------------------------------------------------------------------------------- unit
def test_parameter_names_and_shapes_match_vllm_checkpoint():
    cfg = Eagle3Config.from_policy(LlamaConfig(**POLICY), draft_vocab_size=96)
    shapes = {n: tuple(t.shape) for n, t in Eagle3Draft(cfg).state_dict().items()}
    h, kv = 128, 2 * 32
    assert shapes == {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (h, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, h),
        "midlayer.mlp.gate_proj.weight": (256, h),
        "midlayer.mlp.up_proj.weight": (256, h),
        "midlayer.mlp.down_proj.weight": (h, 256),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (96, h),
        "d2t": (96,),
        "t2d": (128,),
    }
    draft = Eagle3Draft(cfg)
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    assert "embed_tokens" not in " ".join(shapes), "embeddings are the policy's"


def test_config_aux_ids_and_validation():
    four = LlamaConfig(**POLICY)
    assert Eagle3Config.from_policy(four).tap_layers == (1, 2, 3)  # vLLM's (2, 2, 1) collides
    deep = LlamaConfig(**{**POLICY, "num_hidden_layers": 32})
    assert Eagle3Config.from_policy(deep).tap_layers == (2, 16, 29)
    # vLLM concatenates the aux states in layer order, whatever order the config lists
    assert Eagle3Config.from_policy(four, tap_layers=(3, 0, 2)).tap_layers == (0, 2, 3)
    with pytest.raises(ValueError, match="distinct"):
        Eagle3Config.from_policy(four, tap_layers=(2, 2, 1))
    with pytest.raises(ValueError, match="0..3"):
        Eagle3Config.from_policy(four, tap_layers=(1, 2, 4))
    with pytest.raises(ValueError, match="shares the policy's embeddings"):
        Eagle3Config(**{**Eagle3Config.from_policy(four).__dict__, "hidden_size": 64})


def test_build_vocab_mapping():
    counts = torch.tensor([5, 0, 7, 7, 1, 9])
    d2t, t2d = build_vocab_mapping(counts, 3)
    used = torch.tensor([2, 3, 5])  # the 3 most frequent, sorted by id
    assert torch.equal(d2t, used - torch.arange(3)) and d2t.dtype == torch.int64
    assert t2d.tolist() == [False, False, True, True, False, True]
    assert torch.equal(torch.arange(3) + d2t, torch.nonzero(t2d).flatten())
    assert build_vocab_mapping(torch.ones(4), 2)[1].tolist() == [True, True, False, False]  # ties: lower id
    d2t, t2d = build_vocab_mapping(counts, 6)
    assert not d2t.any() and t2d.all()
    with pytest.raises(ValueError):
        build_vocab_mapping(counts, 7)


def test_vocab_mapping_from_token_ids_keeps_frequent_and_forced_ids():
    answers = [[5, 3, 5], [3, 5, 7], [7, 1]]  # counts: 5 -> 3, 3 -> 2, 7 -> 2, 1 -> 1
    d2t, t2d = vocab_mapping_from_token_ids(answers, vocab_size=9, draft_vocab_size=3)
    assert torch.nonzero(t2d).flatten().tolist() == [3, 5, 7]
    assert torch.equal(d2t, torch.tensor([3, 4, 5]))  # target = draft + d2t[draft]
    _, t2d = vocab_mapping_from_token_ids(answers, vocab_size=9, draft_vocab_size=3, always_include=[8, 0])
    assert torch.nonzero(t2d).flatten().tolist() == [0, 5, 8]  # the stop ids first, then the most frequent
    with pytest.raises(ValueError, match="raise draft.draft_vocab_size"):
        vocab_mapping_from_token_ids(answers, 9, 1, always_include=[0, 8])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_mapping_from_token_ids([[9]], 9, 3)


@pytest.mark.parametrize("shift", [-2, 0, 1, 3, 5])
def test_shift_within_docs(shift):
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    x = torch.arange(9.0)[:, None].repeat(1, 2)
    expected = torch.full_like(x, -1.0)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for i in range(a, b):
            if a <= i + shift < b:
                expected[i] = x[i + shift]
    assert torch.equal(shift_within_docs(x, cu, shift, -1.0), expected)


def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _reference_ttt(draft, embeds, aux, position_ids, cu_seqlens, passes):
    """Per document and per pass, with the explicit `[L, d*L]` staircase mask of the paper."""
    cfg, p = draft.cfg, dict(draft.named_parameters())
    hq, hkv, dim, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    logits = [[] for _ in range(passes)]
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        n = b - a
        h = torch.cat([x[a:b] for x in aux], -1) @ p["fc.weight"].T
        keys, values = [], []
        for d in range(1, passes + 1):
            e = torch.zeros_like(embeds[a:b])
            e[: max(n - d, 0)] = embeds[a + d:b]
            x = torch.cat([_rms(e, p["midlayer.input_layernorm.weight"], eps),
                           _rms(h, p["midlayer.hidden_norm.weight"], eps)], -1)
            cos, sin = rope_cos_sin(position_ids[a:b] + d - 1, dim, cfg.rope_theta, x.dtype)
            q = apply_rope((x @ p["midlayer.self_attn.q_proj.weight"].T).view(n, hq, dim), cos, sin)
            keys.append(apply_rope((x @ p["midlayer.self_attn.k_proj.weight"].T).view(n, hkv, dim), cos, sin))
            values.append((x @ p["midlayer.self_attn.v_proj.weight"].T).view(n, hkv, dim))
            k = torch.cat(keys).repeat_interleave(hq // hkv, dim=1)  # [d*n, Hq, D]
            v = torch.cat(values).repeat_interleave(hq // hkv, dim=1)
            i, j = torch.arange(n)[:, None], torch.arange(d * n)[None, :]
            visible = torch.where(j < n, j <= i, j % n == i)  # pass-1 trunk, then diagonals
            s = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
            attn = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)
            r = h + attn.reshape(n, -1) @ p["midlayer.self_attn.o_proj.weight"].T
            m = _rms(r, p["midlayer.post_attention_layernorm.weight"], eps)
            mlp = (F.silu(m @ p["midlayer.mlp.gate_proj.weight"].T) * (m @ p["midlayer.mlp.up_proj.weight"].T))
            h = r + mlp @ p["midlayer.mlp.down_proj.weight"].T
            logits[d - 1].append(_rms(h, p["norm.weight"], eps) @ p["lm_head.weight"].T)
    return [torch.cat(x) for x in logits]


def test_ttt_forward_matches_dense_reference_forward_and_backward():
    draft, k = _small_draft(), 3
    torch.manual_seed(1)
    seqs = [list(range(n)) for n in (5, 1, 7, 2)]  # uneven; docs shorter than K included
    _, pos, cu = pack_sequences(seqs)
    t, h = pos.shape[0], draft.cfg.hidden_size
    embeds = torch.randn(t, h, dtype=torch.float64)
    aux = [torch.randn(t, h, dtype=torch.float64) for _ in range(3)]
    weights = [torch.randn(t, draft.cfg.draft_vocab_size, dtype=torch.float64) for _ in range(k)]

    def run(fn):
        logits = fn(draft, embeds, aux, pos, cu, k)
        loss = sum((lg * w).sum() for lg, w in zip(logits, weights))
        return [lg.detach() for lg in logits], torch.autograd.grad(loss, list(draft.parameters()))

    got, got_grads = run(lambda d, *a: d(*a))
    want, want_grads = run(_reference_ttt)
    for d in range(k):
        torch.testing.assert_close(got[d], want[d], atol=1e-10, rtol=1e-10, msg=f"pass {d + 1}")
    for (name, _), g, w in zip(draft.named_parameters(), got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9, msg=name)


def test_ttt_forward_does_not_train_the_policy():
    draft = _small_draft()
    _, pos, cu = pack_sequences([[0] * 6])
    embeds = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    aux = [torch.randn(6, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    teacher = torch.randn(6, 32, dtype=torch.float64, requires_grad=True)
    logits = draft(embeds, aux, pos, cu, 2)
    loss, _ = ttt_loss(logits, teacher, torch.ones(6), cu, draft.t2d)
    loss.backward()
    assert embeds.grad is None and teacher.grad is None and all(a.grad is None for a in aux)
    assert draft.fc.weight.grad is not None


def test_ttt_loss_masks_weights_and_normalises():
    torch.manual_seed(0)
    cu = torch.tensor([0, 4, 7])
    vocab, used = 6, [0, 2, 3, 5]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    teacher = torch.randn(7, vocab, dtype=torch.float64)
    teacher[5, 4] = 9.0  # the policy's top-1 at position 5 is outside the draft vocab
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1])
    drafts = [torch.randn(7, 4, dtype=torch.float64) for _ in range(2)]
    drafts[0][4] = torch.tensor([0.0, 0.0, 0.0, 5.0])  # anchor 4, pass 1 -> position 5

    total, n_valid, counts, correct = 0.0, 0, [0, 0], [0, 0]
    docs = [range(0, 4), range(4, 7)]
    for d in (1, 2):
        for doc in docs:
            for i in doc:
                j = i + d
                if j not in doc or not mask[j]:
                    continue
                p = teacher[j, used].softmax(-1)
                total += 0.8 ** (d - 1) * -(p * drafts[d - 1][i].log_softmax(-1)).sum().item()
                counts[d - 1] += 1
                n_valid += d == 1
                correct[d - 1] += used[int(drafts[d - 1][i].argmax())] == int(teacher[j].argmax())
    loss, metrics = ttt_loss(drafts, teacher, mask, cu, t2d, pass_decay=0.8)
    assert metrics.count.tolist() == counts == [5, 3]
    assert metrics.correct.tolist() == correct
    assert loss.item() == pytest.approx(total / n_valid, rel=1e-12)
    loss10, _ = ttt_loss(drafts, teacher, mask, cu, t2d, pass_decay=0.8, num_valid_tokens=10)
    assert loss10.item() == pytest.approx(total / 10, rel=1e-12)
    assert metrics.accuracy[0] == correct[0] / 5 and metrics.loss.shape == (2,)


@pytest.mark.parametrize("draft_vocab_size", [20, 32])
def test_export_load_round_trip(tmp_path, draft_vocab_size):
    draft = _small_draft(draft_vocab_size)
    policy_cfg = LlamaConfig(**SMALL, max_position_embeddings=512)
    out = export_draft(draft, tmp_path / "draft", policy_cfg, dtype=torch.float64)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["max_position_embeddings"] == 512
    sizes = (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"])
    assert sizes == (32, draft_vocab_size, 16)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]

    stored = load_file(str(out / "model.safetensors"))
    sync = dict(draft_sync_weights(draft))
    # vLLM rejects `d2t` when the vocabularies are equal; it skips `t2d`
    assert ("d2t" in stored) == (draft_vocab_size < 32) and "t2d" in stored
    assert set(sync) == set(stored) - {"t2d"}
    loaded = load_draft(out, dtype=torch.float64)
    for name, want in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], want), name
    _, pos, cu = pack_sequences([[0] * 5, [0] * 3])
    taps = torch.randn(4, 8, 16, dtype=torch.float64)
    for a, b in zip(draft(taps[0], list(taps[1:]), pos, cu, 2), loaded(taps[0], list(taps[1:]), pos, cu, 2)):
        assert torch.equal(a, b)


def test_export_rejects_a_draft_for_another_policy(tmp_path):
    other = LlamaConfig(**{**SMALL, "vocab_size": 64})
    with pytest.raises(ValueError, match="vocab_size"):
        export_draft(_small_draft(), tmp_path, other)


# ------------------------------------------------------------------- SpecForge / vLLM drafts
def _specforge_world(tmp_path, draft_vocab_size: int = 20):
    """A saved policy and a draft for it in SpecForge's layout (no eagle_config, embed_tokens, d2t and t2d)."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(**SMALL))
    save_pretrained(policy, tmp_path / "policy")
    d2t, t2d = build_vocab_mapping(torch.rand(SMALL["vocab_size"]), draft_vocab_size)
    return policy, write_specforge_draft(tmp_path / "draft", tmp_path / "policy", d2t, t2d, seed=0)


def _edit_draft(draft_dir, config: dict | None = None, drop=(), **tensors):
    if config:
        path = draft_dir / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    state = {k: v for k, v in load_file(str(draft_dir / "model.safetensors")).items() if k not in drop}
    save_file({**state, **tensors}, str(draft_dir / "model.safetensors"))


def test_load_specforge_draft_defaults_aux_layers_drops_equal_embeddings_and_exports(tmp_path):
    policy, draft_dir = _specforge_world(tmp_path)
    stored = load_file(str(draft_dir / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"default aux layers \(1, 2, 3\) for a 4-layer policy"):
        draft = load_draft(draft_dir, policy_cfg=policy.cfg, policy_embeddings=policy.model.embed_tokens.weight)
    assert draft.cfg.tap_layers == (1, 2, 3) and draft.cfg.draft_vocab_size == 20
    assert set(draft.state_dict()) == set(stored) - {"embed_tokens.weight"}
    for name, want in draft.state_dict().items():
        assert torch.equal(stored[name], want), name

    out = export_draft(draft, tmp_path / "exported", policy.cfg)
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert {"d2t", "t2d"} <= set(load_file(str(out / "model.safetensors")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the exported config names its aux layers
        again = load_draft(out, policy_cfg=policy.cfg)
    for name, want in draft.state_dict().items():
        assert torch.equal(again.state_dict()[name], want), name


@pytest.mark.parametrize("keep", ["d2t", "t2d"])
def test_load_draft_completes_the_vocab_mapping(tmp_path, keep):
    policy, draft_dir = _specforge_world(tmp_path)
    stored = load_file(str(draft_dir / "model.safetensors"))
    _edit_draft(draft_dir, drop={"d2t", "t2d", "embed_tokens.weight"} - {keep})
    with pytest.warns(UserWarning, match=r"\(2, 4, 5\) for a 8-layer policy"):  # vLLM's (2, n//2, n-3)
        draft = load_draft(draft_dir, policy_cfg=LlamaConfig(**{**SMALL, "num_hidden_layers": 8}))
    assert torch.equal(draft.d2t, stored["d2t"]) and torch.equal(draft.t2d, stored["t2d"])


def test_load_full_vocab_draft_without_mapping(tmp_path):
    _, draft_dir = _specforge_world(tmp_path, draft_vocab_size=SMALL["vocab_size"])
    _edit_draft(draft_dir, config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 0, 1]}},
                drop={"d2t", "t2d", "embed_tokens.weight"})
    draft = load_draft(draft_dir)
    assert draft.cfg.tap_layers == (0, 1, 3) and draft.t2d.all() and not draft.d2t.any()


def _other_embeddings(d):
    _edit_draft(d, **{"embed_tokens.weight": torch.randn(32, 16)})


BAD_DRAFTS = {
    "embed_tokens.weight \\(32, 16\\) differs from the policy's embeddings": (_other_embeddings, {}),
    "neither d2t nor t2d": (lambda d: _edit_draft(d, drop={"d2t", "t2d"}), {}),
    "d2t/t2d do not map": (lambda d: _edit_draft(d, t2d=load_file(str(d / "model.safetensors"))["t2d"].roll(1)), {}),
    "vocab_size 32 != policy's 64": (None, {"vocab_size": 64}),
    "target_hidden_size 16 != policy's hidden_size 32": (None, {"hidden_size": 32}),
    "tap_layers \\(1, 2, 7\\) beyond the policy's 4 layers": (
        lambda d: _edit_draft(d, config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 7]}}), {}),
    "fc.weight is \\(16, 48\\), the config needs \\(16, 32\\)": (
        lambda d: _edit_draft(d, config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}), {}),
    "'norm_output': True": (lambda d: _edit_draft(d, config={"norm_output": True}), {}),
    "no config.json": (lambda d: (d / "config.json").unlink(), {}),
}


@pytest.mark.parametrize("match", BAD_DRAFTS)
def test_load_draft_rejects_what_would_not_run_as_trained(tmp_path, match):
    policy, draft_dir = _specforge_world(tmp_path)
    edit, policy_changes = BAD_DRAFTS[match]
    if edit:
        edit(draft_dir)
    policy_cfg = LlamaConfig(**{**SMALL, **policy_changes})
    with pytest.raises(ConfigError, match=f"draft.path={draft_dir}.*{match}"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_draft(draft_dir, policy_cfg=policy_cfg, policy_embeddings=policy.model.embed_tokens.weight)


def test_load_draft_without_aux_layers_needs_the_policy(tmp_path):
    _, draft_dir = _specforge_world(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_draft(draft_dir)
    assert str(info.value) == (
        f"draft.path={draft_dir}: config.json does not say which policy layers the draft reads (no "
        f"eagle_config.eagle_aux_hidden_state_layer_ids, as SpecForge writes it); add them, e.g. "
        f'"eagle_config": {{"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}')


def test_a_specforge_draft_is_checked_against_the_toy_policy(tmp_path):
    """The toy policy has no config.json, but `policy.*` and its tokenizer size it: a SpecForge draft (no tap layers
    in its config) is checked against that, in one line naming the path once."""
    from spectrain.config import load_config
    from spectrain.train.inputs import check_draft_path

    _, draft_dir = _specforge_world(tmp_path)
    config = load_config("tiny_cpu", ["draft.init=path", f"draft.path={draft_dir}"])
    with pytest.raises(ConfigError) as info:
        check_draft_path(config, None)
    message = str(info.value)
    assert message.startswith(f"draft.path={draft_dir} does not fit the policy: vocab_size 32 != policy's 83; ")
    assert message.endswith(". Use a draft trained for this policy, or draft.init=scratch")
    assert message.count(str(draft_dir)) == 1 and "\n" not in message


# ---------------------------------------------------------------------------------- vLLM
K = 3
MAX_TOKENS = 32


def _greedy(engine, prompts, max_tokens):
    """Greedy token ids; EOS ignored so every sequence has `max_tokens` (exact counter replay)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _measure(engine, prompts):
    before = engine.spec_decode_counters()
    outputs = _greedy(engine, prompts, MAX_TOKENS)
    return outputs, engine.spec_decode_counters() - before


def _taps(policy, seqs, aux_ids):
    ids, pos, cu = pack_sequences(seqs)
    with torch.no_grad():
        return policy(ids, pos, cu, tap_layers=aux_ids), pos, cu


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from spectrain.tasks.tokenizer import save_tokenizer

    root = tmp_path_factory.mktemp("eagle3")
    torch.manual_seed(0)
    # a non-default rope_theta, so the replay test also checks it reaches vLLM's drafter
    policy = LlamaForCausalLM(LlamaConfig(**POLICY, rope_theta=5000.0)).eval()
    with torch.no_grad():
        policy.lm_head.weight.mul_(20.0)  # confident like a trained LM (greedy choices unchanged)
    save_pretrained(policy, root / "policy")
    save_tokenizer(root / "policy")
    # listed out of order on purpose: vLLM feeds fc in layer order
    draft = Eagle3Draft(Eagle3Config.from_policy(policy.cfg, tap_layers=(3, 1, 2)))
    export_draft(draft, root / "draft", policy.cfg)
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(4, 80, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 9, (8,), generator=g)]
    return SimpleNamespace(policy=policy, draft=draft, policy_dir=root / "policy", draft_dir=root / "draft",
                           prompts=prompts)


@pytest.fixture(scope="module")
def reference(world):
    """Greedy outputs of the policy alone (no draft), K+1 tokens longer than the tests ask."""
    from spectrain.rollout.vllm.engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(world.policy_dir)
    try:
        return _greedy(engine, world.prompts, MAX_TOKENS + K + 1)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def spec_engine(world, reference):
    from spectrain.rollout.vllm.engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(world.policy_dir, world.draft_dir, num_speculative_tokens=K)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def trained_draft(world, reference):
    """The draft co-trained on the fixed policy's own greedy rollouts (TTT, K passes)."""
    seqs = [p + o[:MAX_TOKENS] for p, o in zip(world.prompts, reference)]
    out, pos, cu = _taps(world.policy, seqs, world.draft.cfg.tap_layers)
    response = torch.zeros(pos.shape[0])
    for start, prompt in zip(cu[:-1].tolist(), world.prompts):
        response[start + len(prompt) - 1:start + len(prompt) + MAX_TOKENS - 1] = 1
    draft = load_draft(world.draft_dir)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(30):
        loss, metrics = ttt_loss(draft(out.embeds, out.tap_hidden, pos, cu, K), out.logits, response, cu, draft.t2d)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert metrics.accuracy[0] > 0.5, metrics.accuracy
    return draft


@pytest.fixture(scope="module")
def initial_run(world, spec_engine):
    """Outputs and counter deltas of greedy generation with the freshly initialised draft."""
    spec_engine.sync_draft(draft_sync_weights(world.draft), version=0)
    return _measure(spec_engine, world.prompts)


@pytest.fixture(scope="module")
def trained_run(world, spec_engine, trained_draft):
    """The same after syncing the co-trained draft into the live engine."""
    spec_engine.sync_draft(draft_sync_weights(trained_draft), version=1)
    return _measure(spec_engine, world.prompts)


@pytest.mark.slow
def test_exported_draft_speculates_losslessly(reference, initial_run):
    outputs, delta = initial_run
    assert delta.num_drafts > 0 and delta.num_draft_tokens == K * delta.num_drafts
    assert outputs == [o[:MAX_TOKENS] for o in reference]


@pytest.mark.slow
def test_syncing_a_cotrained_draft_raises_acceptance(reference, initial_run, trained_run):
    (_, before), (outputs, after) = initial_run, trained_run
    assert outputs == [o[:MAX_TOKENS] for o in reference], "the draft sync touched the policy"
    assert after.mean_acceptance_length > before.mean_acceptance_length + 0.5, (before, after)


def _replay_counters(policy, draft, prompts, continuations):
    """(drafts, accepted) greedy chain speculation earns, replayed from the TTT unroll.

    Pass d at anchor a is the d-th draft step after the target verified position a, so a
    round from anchor a accepts the longest prefix of passes whose top-1 is the next token.
    """
    seqs = [p + c for p, c in zip(prompts, continuations)]
    out, pos, cu = _taps(policy, seqs, draft.cfg.tap_layers)
    with torch.no_grad():
        logits = draft(out.embeds, out.tap_hidden, pos, cu, K)
    used = torch.nonzero(draft.t2d).flatten()
    top1 = torch.stack([used[lg.argmax(-1)] for lg in logits]).tolist()  # [K, T] target ids
    drafts = accepted = 0
    for start, prompt, seq in zip(cu[:-1].tolist(), prompts, seqs):
        anchor, generated = len(prompt) - 1, 1  # the prefill emits the first token
        while generated < MAX_TOKENS:
            m = 0
            while m < K and top1[m][start + anchor] == seq[anchor + m + 2]:
                m += 1
            drafts, accepted = drafts + 1, accepted + m
            anchor, generated = anchor + m + 1, generated + m + 1
    return drafts, accepted


@pytest.mark.slow
def test_vllm_acceptance_replays_from_ttt_forward(world, reference, trained_draft, trained_run):
    """vLLM's counters equal a replay from our policy taps + TTT unroll: same aux layers and
    order, shared embeddings, midlayer, norms, positions and branch attention as vLLM."""
    _, delta = trained_run
    drafts, accepted = _replay_counters(world.policy, trained_draft, world.prompts, reference)
    assert 0 < accepted < K * drafts, "replay is only informative with partial acceptance"
    assert (delta.num_drafts, delta.num_accepted_tokens) == (drafts, accepted)

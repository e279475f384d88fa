"""`spectrain plan` and `check_memory_plan`: the arithmetic by hand, the formulas against the tensors autograd
really saves, the shipped 8-GPU recipes against 8 x 80 GiB from config.json alone, and the keys named when a plan
does not fit."""
import json
import math
import re
import shutil
import types
from pathlib import Path

import pytest
import torch

from spectrain.cli import main
from spectrain.config import ConfigError, load_config
from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft, ttt_loss
from spectrain.models.llama import DecoderLayer, LlamaConfig, LlamaForCausalLM, rope_cos_sin
from spectrain.ops.attention import LocalAttentionOps
from spectrain.train import memory_plan as mp
from spectrain.train.inputs import policy_architecture

GIB = 1 << 30
CONFIGS = Path(__file__).parents[1] / "fixtures" / "hf_configs"  # real config.json files, no weights
CHECKPOINTS = {"qwen3_gsm8k": "Qwen3-8B", "llama3_math": "Llama-3.1-8B-Instruct"}
DATA = ["data.train_files=unused/train.jsonl", "data.val_files=unused/val.jsonl"]
# the three precisions: float32; bf16 autocast over float32 weights; bf16 weights (FSDP's gathered units) + autocast
REGIMES = [(torch.float32, False, mp.Precision(4, 4)), (torch.float32, True, mp.Precision(4, 2)),
           (torch.bfloat16, True, mp.Precision(2, 2))]
TOKENS = 40  # a token count no weight dimension shares, so saved activations and weights never coincide


def config_only(tmp_path: Path, name: str) -> Path:
    """A directory holding nothing but a checkpoint's config.json."""
    (tmp_path / name).mkdir()
    shutil.copy(CONFIGS / name / "config.json", tmp_path / name / "config.json")
    return tmp_path / name


def run_plan(capsys, *argv) -> tuple[int, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def total_gib(output: str) -> float:
    return float(re.search(r"^\s+total\s+([\d.]+)$", output, re.M).group(1))


# ---------------------------------------------------------------- the arithmetic by hand

TINY_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 1000, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def tiny_plan(tmp_path, *overrides, gpu=GIB):
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    config = load_config("tiny_cpu", [f"policy.path={tmp_path}", "policy.dtype=bfloat16", "parallel.dp=2",
                                      "parallel.fsdp=true", "grpo.kl_loss_coef=0.1", "grpo.minibatches=1",
                                      "rollout.prompts_per_step=4", "rollout.n=2",
                                      "draft.draft_vocab_size=100", *overrides])
    return mp.plan_config(config, gpu)


def test_plan_matches_the_hand_computed_numbers(tmp_path):
    """H=64, I=96, Q=4x16=64, K=2x16=32, V=1000, L=4, Vd=100, bf16 under FSDP (r=c=2) over S=2 ranks, untied."""
    plan = tiny_plan(tmp_path)
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 96 + 2 * 64  # q,k,v + o + SwiGLU + 2 norms = 30848
    root = 1000 * 64 + 64 + 64 * 1000  # embedding + final norm + lm_head = 128064
    p = 4 * layer + root  # 251456
    assert (plan.parameters, plan.gradients, plan.optimizer) == (4 * p // 2, 4 * p // 2, 8 * p // 2)
    assert plan.reference == 4 * p // 2  # grpo.kl_loss_coef > 0: a frozen float32 copy, sharded
    # gathered in bf16: root + 2 layers, one layer's grads, and the reference's root + 2 layers
    assert plan.gathered == 2 * (root + 2 * layer) + 2 * layer + 2 * (root + 2 * layer)
    # the draft: fc 3H -> H, q/k/v from 2H, o, SwiGLU, 4 norms, lm_head to Vd = 57856 parameters
    draft = 3 * 64 * 64 + 2 * 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 96 + 4 * 64 + 64 * 100
    assert plan.draft == 16 * draft // 2  # co-trained: weights, gradients, 2 moments, over 2 shards

    # tokens: 4 prompts x 2 samples / 1 minibatch / dp 2 = 4 documents of (128 - 24) prompt + 24 answer tokens
    t = 4 * (104 + 24)
    assert plan.inputs.tokens == t == 512
    # per token and layer (r = c = a = 2): 2 norms ((4+2) 64 + 4 each), q/k/v and gate/up inputs (2 x 2 x 64),
    # attention (2 (2x64 + 2x32) + 4 x 4 heads), SwiGLU (4 x 2 x 96)
    per_layer = 2 * (6 * 64 + 4) + 2 * 2 * 64 + 2 * (2 * 64 + 2 * 32) + 4 * 4 + 4 * 2 * 96
    assert per_layer == 2200
    outside = 8 + 2 * 16 * 2 + (6 * 64 + 4) + 2 * 64 + 4  # input id, rotary tables, final norm, lm_head input, lse
    assert plan.activations == plan.activations_full == t * ((4 + 1) * per_layer + outside)
    assert plan.activations_checkpointed == t * (4 * 2 * 64 + 2 * per_layer + outside)
    # fewer tokens than a 4096-token chunk, freed before the layers' backward (one layer of gradients in flight,
    # counted in the activations); the lm_head grad
    assert plan.logits == 512 * 1000 * 8 - t * per_layer + 1000 * 64 * 4
    # checkpointed, the recomputed layer also comes after the chunk is freed
    checkpointed = tiny_plan(tmp_path, "policy.activation_checkpointing=true")
    assert checkpointed.logits == 512 * 1000 * 8 - 2 * t * per_layer + 1000 * 64 * 4
    assert plan.draft_inputs == t * ((3 + 1) * 64 * 2 + 100 * 4 + 8)  # 3 taps + embedding (bf16), teacher, top-1
    assert plan.draft_update == 0  # 3 passes need less than the policy backward freed
    assert plan.engine == int(0.6 * GIB) and plan.reserved == 2 * GIB
    # sleep mode (on for CUDA by default): the engine's share is free while the policy trains; the rollout phase
    # holds the engine, the weights, AdamW's moments, the reference and the draft
    assert plan.inputs.sleep and plan.training == sum(getattr(plan, name) for name in mp.ITEMS if name != "engine")
    assert plan.rollout == plan.engine + plan.parameters + plan.optimizer + plan.reference + plan.draft + 2 * GIB
    assert plan.total == max(plan.training, plan.rollout) and not plan.fits

    # 12 TTT passes need more than the policy freed: the excess is counted
    deep = tiny_plan(tmp_path, "draft.ttt_passes=12")
    draft_pass = 2 * 64 + 3 * (6 * 64 + 4) + 2 * 128 + 2 * 64 + 2 * (2 * 64 + 2 * 32) + 16 + 4 * 2 * 96 + 2 * 16 * 2
    unroll = 2 * 3 * 64 + 12 * (draft_pass + 2 * 64 + 17)  # fc input, passes with the loss's saved rows
    draft_phase = t * (unroll + draft_pass) + 2 * 2 * draft  # + one pass of gradients, + the gathered draft
    freed = plan.activations + plan.logits + plan.gathered
    assert deep.draft_update == draft_phase - freed > 0


def test_unsharded_bf16_plan_replicates_the_state_and_caches_bf16_weights(tmp_path):
    plan = tiny_plan(tmp_path, "parallel.fsdp=false")
    p = 4 * 30848 + 128064  # the parameters above
    assert (plan.parameters, plan.optimizer, plan.reference) == (4 * p, 8 * p, 4 * p)  # every rank holds all
    assert plan.gathered == 2 * p  # autocast's bf16 copy of every trainable weight
    assert plan.inputs.precision == mp.Precision(residual=4, compute=2)  # the residual stream stays float32


def test_a_logits_chunk_smaller_than_the_layers_backward_adds_only_the_lm_head_gradient(tmp_path):
    """The chunk's backward runs before any layer's: the peak is the larger of the two, not their sum."""
    cfg = policy_architecture(load_config("tiny_cpu", []))
    assert mp.logits_bytes(cfg, 100, layers_backward=10**9) == 4 * cfg.vocab_size * cfg.hidden_size
    assert mp.logits_bytes(cfg, 100, layers_backward=0) == (100 * cfg.vocab_size * 8
                                                            + 4 * cfg.vocab_size * cfg.hidden_size)


def test_the_logits_chunk_is_the_chunked_log_softmax_default():
    from spectrain.ops.chunked_logprobs import DEFAULT_CHUNK_TOKENS

    assert mp.LOGITS_CHUNK_TOKENS == DEFAULT_CHUNK_TOKENS == 4096


def test_micro_batch_tokens_keep_whole_documents(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    base = ["policy.path=" + str(tmp_path), "rollout.prompts_per_step=4", "rollout.n=2", "parallel.dp=2",
            "grpo.minibatches=1"]
    tokens = {cap: mp.micro_batch_tokens(load_config("tiny_cpu", [*base, f"grpo.micro_batch_tokens={cap}"]))
              for cap in ("null", 100, 300, 10000)}
    assert tokens == {"null": 4 * 128, 100: 128, 300: 300, 10000: 4 * 128}  # at least a document, at most the minibatch
    cp = load_config("tiny_cpu", [*base, "parallel.cp=2", "grpo.micro_batch_tokens=null"])
    assert mp.micro_batch_tokens(cp) == 4 * 128 // 2


# ---------------------------------------------------------------- the formulas against autograd

def saved_bytes(fn, parameters) -> int:
    """Bytes of the distinct storages autograd saves for the backward while `fn` runs, weights (and their casts)
    left out."""
    numels = {p.numel() for p in parameters}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = (storage.nbytes(), t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for n, size in seen.values() if n // size not in numels)


def packed_batch():
    return torch.cat([torch.arange(17), torch.arange(23)]), torch.tensor([0, 17, TOKENS], dtype=torch.int32)


def policy_config(qk_norm: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, qk_norm=qk_norm)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("dtype, autocast, precision", REGIMES, ids=["float32", "bf16-autocast", "bf16-weights"])
def test_layer_formula_is_what_autograd_saves(qk_norm, dtype, autocast, precision):
    cfg = policy_config(qk_norm)
    layer = DecoderLayer(cfg).to(dtype)
    x = torch.randn(TOKENS, 64, dtype=dtype, requires_grad=True)
    positions, cu = packed_batch()
    cos, sin = rope_cos_sin(positions, 16, 10000.0, dtype)  # shared by all layers: the outside term counts them
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        measured = saved_bytes(lambda: layer(x, cos, sin, cu, LocalAttentionOps()), layer.parameters())
    shared = cos.nbytes + sin.nbytes + cu.nbytes
    assert measured - shared == TOKENS * mp.layer_activation_bytes(cfg, precision)


@pytest.mark.parametrize("dtype, autocast, precision", REGIMES, ids=["float32", "bf16-autocast", "bf16-weights"])
def test_model_formula_is_what_autograd_saves(dtype, autocast, precision):
    cfg = policy_config(qk_norm=True)
    model = LlamaForCausalLM(cfg).to(dtype)
    positions, cu = packed_batch()
    ids, targets = torch.randint(0, 100, (TOKENS,)), torch.randint(0, 100, (TOKENS,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # the logprobs the loss reads, chunked
        model.logprob_chunk_tokens = 16
        measured = saved_bytes(lambda: model(ids, positions, cu, compute_logits=False, logprob_targets=targets),
                               model.parameters())
    per_token = 3 * mp.layer_activation_bytes(cfg, precision) + mp.outside_activation_bytes(cfg, precision)
    assert measured - cu.nbytes - targets.nbytes == TOKENS * per_token  # the batch's own tensors left out


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("dtype, autocast, precision", REGIMES, ids=["float32", "bf16-autocast", "bf16-weights"])
def test_draft_formula_is_what_autograd_saves(passes, dtype, autocast, precision):
    d = Eagle3Config.from_policy(policy_config(qk_norm=False), draft_vocab_size=50)
    draft = Eagle3Draft(d).to(dtype)
    embeds, taps = torch.randn(TOKENS, 64, dtype=dtype), [torch.randn(TOKENS, 64, dtype=dtype) for _ in range(3)]
    teacher, mask = torch.randn(TOKENS, 100, dtype=dtype), torch.ones(TOKENS)
    positions, cu = packed_batch()

    def update():
        hidden = draft(embeds, taps, positions, cu, passes, normed_hidden=True)
        ttt_loss(hidden, teacher, mask, cu, draft.t2d, lm_head=draft.lm_head.weight, loss_kernel="chunked")

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        measured = saved_bytes(update, [*draft.parameters(), teacher[:, :50]])  # the teacher is the draft inputs' row
    assert 0 <= measured - TOKENS * mp.draft_unroll_bytes(d, precision, passes) <= 64  # + cu_seqlens and the like


@pytest.mark.parametrize("cfg", [
    LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, qk_norm=True),
    LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True, o_proj_bias=True),
], ids=["qwen3", "tied-with-biases"])
def test_parameter_counts_are_the_modules(cfg):
    assert mp.policy_parameters(cfg) == sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    d = Eagle3Config.from_policy(cfg, draft_vocab_size=120, tap_layers=(0, 1))
    assert mp.draft_parameters(d) == sum(p.numel() for p in Eagle3Draft(d).parameters())


def test_pipeline_shares_put_the_remainder_first():
    shares = mp.pipeline_shares(10, 4, 1)
    assert [s.layers for s in shares] == [3, 3, 2, 2]
    assert [(s.embedding, s.head, s.engine) for s in shares] == [(True, False, True), (False, False, False),
                                                                 (False, False, False), (False, True, False)]
    interleaved = mp.pipeline_shares(10, 2, 2)  # stages of 3, 3, 2, 2 layers: rank 0 runs stages 0 and 2
    assert [s.layers for s in interleaved] == [5, 5] and interleaved[1].head
    assert all(s.engine for s in mp.pipeline_shares(10, 4, 1, engine_everywhere=True))  # one engine per rank


def test_every_gpu_plans_an_engine_unless_one_is_kept_on_rank_0():
    fixed = load_config("tiny_cpu", ["parallel.pp=2", "parallel.microbatches=2"])
    bandit = load_config("tiny_cpu_bandit", ["parallel.pp=2", "parallel.microbatches=2"])  # engines in lockstep
    rank0 = load_config("tiny_cpu", ["parallel.pp=2", "parallel.microbatches=2", "rollout.engine_ranks=rank0"])
    gib = 80 << 30
    assert mp.plan_config(fixed, gib).engine == mp.plan_config(rank0, gib).engine == int(0.6 * gib)
    # pp rank 1 (the head's) is the busiest once it hosts an engine too; without one the plan is rank 0's
    assert mp.plan_config(fixed, gib).inputs.share.head and mp.plan_config(bandit, gib).inputs.share.head
    assert not mp.plan_config(rank0, gib).inputs.share.head


# ---------------------------------------------------------------- the shipped recipes from config.json alone

@pytest.mark.parametrize("recipe", sorted(CHECKPOINTS))
def test_shipped_recipe_fits_8_x_80_gib(recipe, tmp_path, capsys):
    code, out = run_plan(capsys, recipe, f"policy.path={config_only(tmp_path, CHECKPOINTS[recipe])}")
    assert code == 0, out
    assert total_gib(out) < 80 and "verdict: fits" in out
    assert "FSDP over 8 ranks" in out and "checkpointed: 8192 tokens" in out


@pytest.mark.parametrize("recipe", sorted(CHECKPOINTS))
def test_a_16_gib_gpu_is_refused_with_the_keys_to_change(recipe, tmp_path, capsys):
    code, out = run_plan(capsys, recipe, f"policy.path={config_only(tmp_path, CHECKPOINTS[recipe])}",
                         "--gpu-memory", "16")
    assert code == 1, out
    verdict = out.splitlines()[-1]
    assert verdict.startswith("verdict: does not fit"), verdict
    fix = re.search(r"To fit, set (.*) \(plans to ([\d.]+) GiB a GPU on (\d+) nodes? x 8 GPUs\)", verdict)
    assert fix, verdict
    keys = fix.group(1).split()  # the suggestion is itself a layout that fits, at the total it said
    code, out = run_plan(capsys, recipe, f"policy.path={tmp_path / CHECKPOINTS[recipe]}", *keys, "--gpu-memory", "16")
    assert code == 0 and total_gib(out) == float(fix.group(2)), out


@pytest.mark.parametrize("overrides, named", [
    (["policy.activation_checkpointing=false", "grpo.micro_batch_tokens=null", "rollout.gpu_memory_utilization=0.6"],
     {"policy.activation_checkpointing", "grpo.micro_batch_tokens"}),  # the recipe without its memory keys
    (["parallel.fsdp=false"], {"parallel.fsdp"}),
    (["parallel.fsdp=false", "parallel.dp=4", "parallel.pp=2", "grpo.kl_loss_coef=0"], {"parallel.fsdp"}),
    (["parallel.fsdp=false", "parallel.dp=1", "parallel.pp=2", "grpo.kl_loss_coef=0"], {"parallel.pp"}),
], ids=["checkpointing-and-micro-batch", "fsdp", "fsdp-in-stages", "more-stages"])
def test_suggested_keys_make_the_plan_fit(overrides, named, tmp_path, capsys):
    """The planner names the keys, with values, and with them the same command fits, at the total it said."""
    policy = f"policy.path={config_only(tmp_path, CHECKPOINTS['qwen3_gsm8k'])}"
    code, out = run_plan(capsys, "qwen3_gsm8k", policy, *overrides)
    assert code == 1
    fix = re.search(r"To fit, set (.*) \(plans to ([\d.]+) GiB a GPU", out)
    assert fix, out
    keys = fix.group(1).split()
    assert {k.split("=")[0] for k in keys} >= named
    code, out = run_plan(capsys, "qwen3_gsm8k", policy, *overrides, *keys)
    assert code == 0 and total_gib(out) == float(fix.group(2)), out


def test_plan_needs_no_weights_and_no_prompt_files(tmp_path, capsys):
    code, out = run_plan(capsys, "qwen3_gsm8k")
    assert code == 2 and "['policy.path']" in out, out  # the prompt files are not asked for: the plan never reads them
    code, out = run_plan(capsys, "qwen3_gsm8k", f"policy.path={tmp_path / 'absent'}")
    assert code == 2 and "policy.path" in out and "config.json" in out, out


def test_plan_asks_only_for_config_json(tmp_path, capsys):
    code, out = run_plan(capsys, "qwen3_gsm8k", f"policy.path={config_only(tmp_path, 'Qwen3-8B')}")
    assert code == 0, out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = run_plan(capsys, "qwen3_gsm8k", f"policy.path={empty}")
    assert code == 2 and out.splitlines() == [
        f"error: policy.path: {empty} holds no config.json; point policy.path at a local Hugging Face checkpoint "
        "(config.json and *.safetensors; `spectrain plan` reads only its config.json), or null for the toy policy"], out


def test_a_config_json_without_the_model_size_is_refused(tmp_path, capsys):
    """transformers would fill the absent sizes with its defaults: an 8B-sized model nobody asked for."""
    sized = {k: v for k, v in TINY_HF.items() if k not in ("hidden_size", "num_hidden_layers")}
    (tmp_path / "config.json").write_text(json.dumps(sized))
    code, out = run_plan(capsys, "tiny_cpu", f"policy.path={tmp_path}")
    assert code == 2 and out.splitlines() == [
        f"error: policy.path: {tmp_path}/config.json lacks hidden_size, num_hidden_layers; use the config.json the "
        "checkpoint was released with, which sets the model's size"], out


@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_gpu_memory_must_be_a_positive_finite_number(value, capsys):
    code, out = run_plan(capsys, "tiny_cpu", "--gpu-memory", value)
    assert code == 2 and out.splitlines() == [
        f"error: --gpu-memory: is {float(value)}; give one GPU's memory in GiB, a finite number above 0, "
        "e.g. --gpu-memory 80"], out


def test_tiny_cpu_plans_without_a_checkpoint(capsys):
    code, out = run_plan(capsys, "tiny_cpu")
    assert code == 0, out
    assert "vocab 83" in out and "replicated (no FSDP)" in out  # the toy policy over the character tokenizer


# ---------------------------------------------------------------- the start-up check

def fake_gpu(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="Fake GPU", total_memory=int(gib * GIB)))


def qwen3(tmp_path, *overrides):
    return load_config("qwen3_gsm8k", [f"policy.path={config_only(tmp_path, 'Qwen3-8B')}", *DATA, *overrides])


@pytest.mark.parametrize("overrides", [["rollout.enable_sleep_mode=false"], ["rollout.gpu_memory_utilization=0.9"]],
                         ids=["engine-held-through-training", "rollout-phase-too-large"])
def test_check_memory_plan_names_the_key_when_the_gpu_is_too_small(overrides, tmp_path, monkeypatch):
    fake_gpu(monkeypatch, 60)
    config = qwen3(tmp_path, *overrides)
    with pytest.raises(ConfigError, match=r"Fake GPU \(60.00 GiB\).*set rollout\.gpu_memory_utilization=0\.\d+") as err:
        mp.check_memory_plan(config)
    value = re.search(r"rollout\.gpu_memory_utilization=(0\.\d+)", str(err.value)).group(1)
    mp.check_memory_plan(load_config("qwen3_gsm8k", [f"policy.path={config.policy.path}", *DATA, *overrides,
                                                     f"rollout.gpu_memory_utilization={value}"]))  # the fix fits


def test_check_memory_plan_passes_a_plan_that_fits_and_skips_cpu(tmp_path, monkeypatch):
    fake_gpu(monkeypatch, 80)
    config = qwen3(tmp_path)
    mp.check_memory_plan(config)
    fake_gpu(monkeypatch, 1)  # nothing to plan off CUDA: a CPU run, or no GPU at all
    mp.check_memory_plan(load_config("qwen3_gsm8k", [f"policy.path={config.policy.path}", *DATA,
                                                     "trainer.accelerator=cpu"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mp.check_memory_plan(config)


# ---------------------------------------------------------------- the engine's share, sleep mode, the bf16 reference

PUBLIC = {"Qwen3-8B": 8_190_735_360, "Qwen2.5-32B": 32_763_876_352, "Llama-3.1-70B": 70_553_706_496}


def public_config(tmp_path, name, recipe="qwen3_gsm8k", *overrides):
    path = tmp_path / name if (tmp_path / name).is_dir() else config_only(tmp_path, name)
    return load_config(recipe, [f"policy.path={path}", *DATA, *overrides])


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_parameter_counts(name, tmp_path):
    assert mp.policy_parameters(policy_architecture(public_config(tmp_path, name))) == PUBLIC[name]


def test_engine_share_must_hold_its_weight_shard_and_a_kv_cache(tmp_path):
    """Qwen2.5-32B at dp=32 with TP=1 engines used to plan 'fits: 78.28 of 80.00 GiB' with a 32 GiB engine share:
    61 GiB of bf16 weights cannot load in it."""
    config = public_config(tmp_path, "Qwen2.5-32B", "qwen3_gsm8k", "parallel.dp=32")
    plan = mp.plan_config(config, 80 * GIB)
    # 32,763,876,352 parameters x 2 B (bf16) / TP 1; KV per token: 2 (k, v) x 64 layers x 8 kv heads x 128 x 2 B
    assert plan.inputs.engine_weights == 32_763_876_352 * 2
    assert plan.inputs.engine_kv_token == 2 * 64 * 8 * 128 * 2 == 262_144
    assert plan.inputs.engine_kv_min == 262_144 * 2048  # one rollout.max_model_len sequence
    assert plan.engine == int(0.4 * 80 * GIB) and not plan.engine_holds and not plan.fits
    verdict = mp.verdict(plan, config)
    assert verdict.startswith("does not fit: the rollout engine's share (32.00 GiB) cannot hold its weight shard "
                              "(61.03 GiB at rollout.tensor_parallel_size=1) plus a minimum KV cache (0.50 GiB)")
    # TP over kv heads: TP=4 holds 2 of the 8 kv heads; TP=16 would still hold one (replicated)
    assert mp.kv_bytes_per_token(plan.inputs.policy, 2, 4) == 2 * 64 * 2 * 128 * 2
    assert mp.kv_bytes_per_token(plan.inputs.policy, 2, 16) == 2 * 64 * 1 * 128 * 2
    # vllm_kwargs.max_num_seqs: that many full sequences
    many = mp.plan_config(with_keys(config, {"rollout.vllm_kwargs": {"max_num_seqs": 4}}), 80 * GIB)
    assert many.inputs.engine_kv_min == 4 * 262_144 * 2048


def with_keys(config, overrides):
    return mp.with_overrides(config, overrides)


@pytest.mark.parametrize("name, recipe, overrides", [
    ("Qwen2.5-32B", "qwen3_gsm8k", ["parallel.dp=32"]),
    ("Qwen2.5-32B", "qwen3_gsm8k", ["parallel.dp=8"]),
    ("Llama-3.1-70B", "llama3_math", ["parallel.dp=64", "rollout.tensor_parallel_size=4",
                                      "rollout.gpu_memory_utilization=0.4"]),
    ("Llama-3.1-70B", "llama3_math", ["parallel.dp=8"]),
], ids=["32b-dp32", "32b-dp8", "70b-dp64-tp4", "70b-dp8"])
def test_the_suggestion_is_the_smallest_change_that_fits(name, recipe, overrides, tmp_path):
    """Each wrong verdict of the issue: the suggestion, re-planned, fits with an engine that holds its weights, and
    no layout on fewer GPUs fits."""
    config = public_config(tmp_path, name, recipe, *overrides)
    fixes, fixed = mp.suggest_fixes(config, 80 * GIB)
    assert fixes and fixed.fits and fixed.engine_holds
    again = mp.plan_config(mp.with_overrides(config, fixes), 80 * GIB)
    assert again.fits and again.total == fixed.total
    world = mp._world(config, fixes)
    assert world <= 64  # never dp=128 / dp=512 for these
    for layout in mp._layouts(config, policy_architecture(config)):
        if mp._world(config, layout) < world and mp._valid(mp.with_overrides(config, layout)):
            assert not mp._same_gpus(config, policy_architecture(config), 80 * GIB, layout)[1].fits, layout


@pytest.mark.parametrize("name, recipe", [("Qwen3-8B", "qwen3_gsm8k"), ("Qwen2.5-32B", "qwen3_gsm8k"),
                                          ("Llama-3.1-70B", "llama3_math")])
def test_no_fits_verdict_leaves_an_engine_unable_to_hold_its_weights(name, recipe, tmp_path):
    for dp in (8, 32, 128):
        for tp in (1, 2, 4, 8):
            for share in (0.3, 0.6, 0.8):
                for sleep in ("true", "false"):
                    config = public_config(tmp_path, name, recipe, f"parallel.dp={dp}",
                                           f"rollout.tensor_parallel_size={tp}",
                                           f"rollout.gpu_memory_utilization={share}",
                                           f"rollout.enable_sleep_mode={sleep}")
                    plan = mp.plan_config(config, 80 * GIB)
                    x = plan.inputs
                    weights = math.ceil(PUBLIC[name] * 2 / tp)
                    kv = 2 * x.policy.num_hidden_layers * math.ceil(x.policy.num_key_value_heads / tp) * \
                        x.policy.head_dim * 2 * config.rollout.max_model_len
                    assert (x.engine_weights, x.engine_kv_min) == (weights, kv)
                    if plan.fits:
                        assert int(share * 80 * GIB) >= weights + kv, (dp, tp, share)
                        assert plan.total <= 80 * GIB


def test_sleep_mode_peak_is_the_larger_phase_and_plans_host_memory(tmp_path):
    awake = mp.plan_config(public_config(tmp_path, "Qwen3-8B", "qwen3_gsm8k", "rollout.enable_sleep_mode=false"),
                           80 * GIB)
    asleep = mp.plan_config(public_config(tmp_path, "Qwen3-8B"), 80 * GIB)  # None: on with CUDA
    assert not awake.inputs.sleep and asleep.inputs.sleep
    assert awake.total == awake.training + awake.engine
    assert asleep.total == max(asleep.training, asleep.rollout) < awake.total
    # sleep level 1 offloads each GPU's weight shard to host memory: 8 engines a node, 8.19e9 x 2 B each
    assert asleep.inputs.host_per_node == 8 * 8_190_735_360 * 2 and awake.inputs.host_per_node == 0
    cpu = mp.plan_config(public_config(tmp_path, "Qwen3-8B", "qwen3_gsm8k", "trainer.accelerator=cpu"), 80 * GIB)
    assert not cpu.inputs.sleep


def test_bf16_reference_halves_the_reference_row(tmp_path):
    fp32 = tiny_plan(tmp_path)
    bf16 = tiny_plan(tmp_path, "grpo.reference_dtype=bfloat16")
    p = mp.policy_parameters(fp32.inputs.policy)
    assert (fp32.reference, bf16.reference) == (4 * p // 2, 2 * p // 2)  # sharded over dp=2
    with pytest.raises(ConfigError, match="grpo.reference_dtype"):
        load_config("tiny_cpu", ["grpo.reference_dtype=float16"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_dtype_follows_the_key_and_the_kl_stays_finite(dtype):
    from spectrain.tasks.tokenizer import CharTokenizer
    from spectrain.train.grpo import kl_estimate
    from spectrain.train.module import GRPOModule
    from tests.helpers import mixed_length_batch, tiny_policy

    module = GRPOModule(load_config(None, ["grpo.kl_loss_coef=0.1", f"grpo.reference_dtype={dtype}"]), tiny_policy(),
                        None, CharTokenizer(), reward_fn=None)
    assert {p.dtype for p in module.reference.parameters()} == {getattr(torch, dtype)}
    assert {p.dtype for p in module.policy.parameters()} == {torch.float32}  # the policy is untouched
    batch = mixed_length_batch([(3, 5), (4, 2), (2, 6)], module.policy.cfg.vocab_size)
    ref = module.reference_logprobs(batch)
    logp = module.policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, compute_logits=False,
                         logprob_targets=batch.targets).logprobs
    kl = kl_estimate(logp.float(), ref.float())[batch.response_mask]
    assert torch.isfinite(kl).all() and (kl >= -1e-6).all()
    if dtype == "float32":
        assert torch.allclose(kl, torch.zeros_like(kl), atol=1e-6)  # the reference is the policy's copy
    else:
        assert kl.abs().max() < 0.1  # bf16 rounding of the same weights

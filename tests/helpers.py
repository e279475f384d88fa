"""What several test files share: the shrunken recipe, metric readers, a tiny policy, dense attention references."""
import csv
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft, build_vocab_mapping
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train.step import StepModule

TINY = ["sft.steps=20", "sft.batch_size=16", "draft.warmup_steps=10", "rollout.prompts_per_step=4",
        "rollout.n=4", "eval.prompts=8", "trainer.progress_bar=false",
        "trainer.checkpoint_every_n_steps=1", "sync.check_alive=false",
        "grpo.minibatches=2", "grpo.ppo_epochs=2", "grpo.kl_loss_coef=0.05",
        "eval.every_n_steps=1", "eval.samples=2"]  # 4 clipped updates per step, KL to warm start


def metrics(run_dir):
    rows = []
    for path in sorted((run_dir / "logs").glob("version_*/metrics.csv")):
        with open(path) as f:
            rows += list(csv.DictReader(f))
    return rows


# wall-clock columns differ between any two runs; everything else must be identical
TIMING = ("time/", "rollout/seconds", "rollout/tokens_per_s", "draft/seconds", "spot/seconds")


def logged_steps(run_dir: Path) -> dict[int, dict[str, str]]:
    """Every logged value by step over all log segments; a value logged twice for a step fails."""
    steps: dict[int, dict[str, str]] = {}
    for path in sorted((run_dir / "logs").glob("version_*/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                merged = steps.setdefault(int(row["step"]), {})
                for key, value in row.items():
                    if value == "" or key == "step" or key.startswith(TIMING):
                        continue
                    assert key not in merged, f"{key} logged twice for step {row['step']} in {run_dir}"
                    merged[key] = value
    return steps


def column(rows: list[dict], key: str) -> list[float]:
    """The steps' values of one metric ("nan" stays NaN, so range checks on it fail)."""
    return [float(r[key]) for r in rows if r.get(key)]


def tiny_policy(seed: int = 0) -> LlamaForCausalLM:
    """Random weights with a large init, so greedy continuations are not all the same token."""
    tok = CharTokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, initializer_range=0.2))
    return model


class StandInModule(nn.Module):
    """What the plans and `draft_loss` read of a GRPOModule (policy, draft, draft_inputs), in float64."""

    def __init__(self, policy: dict, tap_layers: tuple[int, ...], seed: int, draft_vocab_size: int = 24) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.policy = LlamaForCausalLM(LlamaConfig(**policy)).double()
        self.draft = Eagle3Draft(Eagle3Config.from_policy(self.policy.cfg, tap_layers=tap_layers,
                                                          draft_vocab_size=draft_vocab_size)).double()
        with torch.no_grad():  # O(1) weights, so every term of the losses matters
            for p in self.parameters():
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        self.draft.set_vocab_mapping(*build_vocab_mapping(torch.rand(policy["vocab_size"]), draft_vocab_size))
        self.draft_inputs = []


def mixed_length_batch(lengths: list[tuple[int, int]], vocab_size: int):
    """Documents of (prompt, response) lengths with random tokens, advantages and engine logprobs (seeded)."""
    from spectrain.batch import build_rollout_batch
    from spectrain.rollout.engine import Completion

    g = torch.Generator().manual_seed(1)
    completions = []
    for i, (p_len, r_len) in enumerate(lengths):
        ids = torch.randint(4, vocab_size, (p_len + r_len,), generator=g).tolist()
        logprobs = (-3 * torch.rand(r_len, generator=g, dtype=torch.float64) - 0.05).tolist()
        completions.append(Completion(i, ids[:p_len], ids[p_len:], logprobs, True))
    return build_rollout_batch(completions, torch.randn(len(completions), generator=g))


def float64_grpo_loss_fn(num_tokens):
    """GRPO against the engine's logprobs (so the ratio clips somewhere), in float64."""
    from spectrain.train.grpo import grpo_loss

    def loss_fn(logprobs, part):
        out = grpo_loss(logprobs, part.rollout_logprobs.double(), part.advantages.double(), part.response_mask,
                        0.2, num_tokens=num_tokens)
        return out.loss, logprobs

    return loss_fn


def write_hf_checkpoint(path, config, seed: int = 0, **save_kwargs):
    """A random checkpoint written by transformers (returned, in eval mode); every tensor (norms and
    biases too) is random, so a dropped bias, norm or rope detail shows in the logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.2 if p.dim() == 1 else 0.1)
    model.save_pretrained(path, **save_kwargs)
    return model.eval()


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def dense_mask(lens_q: list[int], lens_k: list[int], causal: bool) -> torch.Tensor:
    """Full [Tq, Tk] visibility mask, built explicitly (reference only)."""
    mask = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        block = torch.ones(lq, lk, dtype=torch.bool)
        mask[q0 : q0 + lq, k0 : k0 + lk] = block.tril() if causal else block
        q0, k0 = q0 + lq, k0 + lk
    return mask


def dense_attention(q, k, v, mask, scale=None):
    """Reference (out, lse) by the textbook formula; rows with no visible key: 0, -inf."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe_lse = torch.where(lse == float("-inf"), 0.0, lse)
    p = torch.where(mask, torch.exp(s - safe_lse.unsqueeze(-1)), 0.0)
    return torch.einsum("hqk,khd->qhd", p, v), lse.transpose(0, 1)


def staircase_mask(lengths: list[int], n_pass: int) -> torch.Tensor:
    """[T, d*T] TTT mask: causal per document over pass-1 keys, then one diagonal per pass."""
    t = sum(lengths)
    trunk = torch.zeros(t, t, dtype=torch.bool)
    start = 0
    for n in lengths:
        trunk[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    return torch.cat([trunk] + [torch.eye(t, dtype=torch.bool)] * (n_pass - 1), dim=1)


def dense_ttt(q, keys, values, mask, scale=None):
    """TTT reference: plain masked softmax attention over all passes' keys concatenated."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // keys[0].shape[1]
    k = torch.cat(keys).repeat_interleave(group, dim=1)
    v = torch.cat(values).repeat_interleave(group, dim=1)
    s = (torch.einsum("qhd,khd->hqk", q, k) * scale).masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def step_outputs(module, step: int = 1) -> dict:
    """What `on_train_batch_end` gets as `outputs` after GRPO step `step`, built from a stand-in module's fields
    (the `StepResult` parts the callbacks read: the rollout's counters, the logprob check, the batch)."""
    return {"step": SimpleNamespace(step=step, rollout=getattr(module, "rollout_stats", None),
                                    policy=SimpleNamespace(engine_logprob_diff=getattr(module, "engine_logprob_diff",
                                                                                       float("nan"))),
                                    batch=getattr(module, "rollout_batch", None))}


class StepModuleStandIn(SimpleNamespace, StepModule):
    """Just enough of GRPOModule for the callbacks (the `StepModule` contract): logged values kept, one rank."""

    global_step = 0
    teacher_dtype = torch.float32
    trains_draft = True

    def log(self, name, value, *_, **__):
        self.logged[name] = float(value)

    def log_dict(self, dictionary, *_, **__):
        self.logged.update({k: float(v) for k, v in dictionary.items()})

    def manual_backward(self, loss, *_, **__):
        loss.backward()

    def sum_over_ranks(self, tensor):
        return tensor

    def max_over_ranks(self, tensor):
        return tensor


def sync_step(callback, module: StepModuleStandIn, step: int, woke: bool = False):
    """GRPO step `step`'s weight-sync phase as GRPOModule runs it (the rollout's acceptance to the draft's owner,
    then `WeightSync.sync_weights`), on a stand-in module whose `rollout_stats` is the step's rollout."""
    module.global_step = step
    if module.draft is not None and module.rollout_stats is not None:
        module.draft.observe(module.rollout_stats.spec)
    return callback.sync_weights(module, step_outputs(module, step)["step"], woke)


def export_engine_models(root: Path) -> tuple[Path, Path]:
    """A random 4-layer policy (with the char tokenizer) and a random EAGLE-3 draft for it, as vLLM loads them."""
    from spectrain.models.eagle3 import export_draft
    from spectrain.models.hf_io import save_pretrained
    from spectrain.tasks.tokenizer import save_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    policy_dir = save_pretrained(LlamaForCausalLM(cfg), root / "policy")
    save_tokenizer(policy_dir)
    return policy_dir, export_draft(Eagle3Draft(Eagle3Config.from_policy(cfg)), root / "draft", cfg)

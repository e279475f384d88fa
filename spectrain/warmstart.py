"""Warm start: a short SFT of the random policy on the task's worked answers, cached in the run.

GRPO needs a policy that already gets some answers right (a group whose samples all score
0 has zero advantage and teaches nothing). The result is cached under
`<run_dir>/warmstart/` with the settings that produced it, so the next run with the same
settings reuses it instead of training again.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from spectrain.models.hf_io import load_pretrained, save_pretrained
from spectrain.models.llama import LlamaForCausalLM
from spectrain.rl.batch import RolloutBatch, build_rollout_batch
from spectrain.rl.grpo import token_logprobs
from spectrain.rollout.base import Completion


def examples_to_batch(examples, tokenizer) -> RolloutBatch:
    """Teacher-forced batch: prompt + worked answer, loss on the answer tokens only."""
    completions = [Completion(i, tokenizer.encode(ex.prompt),
                              tokenizer.encode(ex.target, add_bos=False) + [tokenizer.eos_id], [], True)
                   for i, ex in enumerate(examples)]
    return build_rollout_batch(completions, torch.zeros(len(completions)))


def sft_loss(policy: LlamaForCausalLM, batch: RolloutBatch) -> torch.Tensor:
    out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens)
    logp = token_logprobs(out.logits, batch.targets)
    mask = batch.response_mask.float()
    return -(logp * mask).sum() / mask.sum().clamp_min(1.0)


def train_sft(policy: LlamaForCausalLM, task, tokenizer, steps: int, batch_size: int, lr: float,
              seed: int, progress: bool = True) -> list[float]:
    """AdamW with linear warm-up and cosine decay to 10% of `lr`; returns the loss per step."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * s / max(1, steps))))
    policy.train()
    losses = []
    bar = tqdm(range(steps), desc="warm-start SFT", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        loss = sft_loss(policy, examples_to_batch(task.sample(batch_size, rng), tokenizer))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def warm_start_policy(config, policy: LlamaForCausalLM, task, tokenizer, cache_root: Path,
                      progress: bool = True) -> tuple[LlamaForCausalLM, dict]:
    """Return the SFT'd policy, training it only if no matching cache exists in the run."""
    cache = cache_root
    settings = {"policy": asdict(config.policy), "task": asdict(config.task), "sft": asdict(config.sft),
                "seed": config.trainer.seed}
    meta_path = cache / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("settings") == settings:
            return load_pretrained(cache / "policy"), meta
    losses = train_sft(policy, task, tokenizer, config.sft.steps, config.sft.batch_size, config.sft.lr,
                       seed=config.trainer.seed, progress=progress) if config.sft.enabled else []
    save_pretrained(policy, cache / "policy", tokenizer=tokenizer)
    meta = {"settings": settings, "final_loss": losses[-1] if losses else None, "steps": len(losses)}
    meta_path.write_text(json.dumps(meta, indent=2))
    return policy, meta

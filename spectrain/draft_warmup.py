"""Build the EAGLE-3 draft for a policy and, optionally, warm it up offline before RL.

The warm-up trains the draft on the warm-started policy's own teacher-forced forward over
the task's worked answers (the same TTT loss as online co-training), so speculation is
alive from the first rollout. Cached in `<run_dir>/warmstart/draft` like the SFT policy (and as
immutable: spectrain/warmstart.py `cached`).
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft, export_draft, load_draft, ttt_loss
from spectrain.models.llama import LlamaForCausalLM
from spectrain.warmstart import CACHE_META, cached, examples_to_batch, writing_cache


def build_draft(config, policy: LlamaForCausalLM) -> Eagle3Draft:
    ids = config.draft.aux_layer_ids
    cfg = Eagle3Config.from_policy(policy.cfg, aux_layer_ids=tuple(ids) if ids is not None else None)
    torch.manual_seed(config.trainer.seed + 1)
    return Eagle3Draft(cfg)


def warm_up_draft(draft: Eagle3Draft, policy: LlamaForCausalLM, source, tokenizer, steps: int,
                  batch_size: int, lr: float, ttt_steps: int, pass_decay: float, seed: int,
                  progress: bool = True) -> list[float]:
    """Offline TTT on teacher-forced task data; the policy is frozen (no grad)."""
    rng = random.Random(f"draft-warmup:{seed}")
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    aux_ids = draft.cfg.aux_layer_ids
    losses = []
    bar = tqdm(range(steps), desc="draft warm-up", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        batch = examples_to_batch(source.sample(batch_size, rng), tokenizer)
        with torch.no_grad():
            out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, capture_layers=aux_ids)
        logits = draft(out.embeds, out.aux_hidden, batch.position_ids, batch.cu_seqlens, ttt_steps,
                       ops=policy.attention_ops)
        loss, metrics = ttt_loss(logits, out.logits, batch.response_mask, batch.cu_seqlens, draft.t2d, pass_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=f"{metrics.accuracy[0].item():.2f}")
    return losses


def draft_cache_key(config) -> dict:
    """Everything the warmed-up draft depends on.

    Not `draft.mode` (co-trained / frozen) nor `draft.num_speculative_tokens`: they do not
    change the warm-up, so runs that differ only in them share it.
    """
    draft_settings = {k: v for k, v in asdict(config.draft).items()
                      if k in ("aux_layer_ids", "lr", "warmup_steps", "ttt_steps", "pass_decay")}
    return {"draft": draft_settings, "policy": asdict(config.policy), "sft": asdict(config.sft),
            "task": asdict(config.task), "seed": config.trainer.seed}


def build_and_warm_up_draft(config, policy: LlamaForCausalLM, source, tokenizer, cache_root: Path) -> Eagle3Draft:
    """The draft from `<cache_root>/draft` if it was warmed up under these settings, else built (and cached)."""
    d = config.draft
    cache, key = cache_root / "draft", draft_cache_key(config)
    if cached(cache, key, "draft warm-up"):
        return load_draft(cache)
    draft = build_draft(config, policy)
    losses = []
    if d.warmup_steps > 0:
        losses = warm_up_draft(draft, policy, source, tokenizer, d.warmup_steps, config.sft.batch_size, d.lr,
                               d.ttt_steps, d.pass_decay, config.trainer.seed, config.trainer.progress_bar)
    with writing_cache(cache) as scratch:
        export_draft(draft, scratch, policy.cfg)
        (scratch / CACHE_META).write_text(json.dumps({"settings": key, "final_loss": losses[-1] if losses else None},
                                                     indent=2))
    return draft

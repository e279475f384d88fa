"""Warm start, before RL: a short SFT of the policy, then an offline warm-up of its EAGLE-3 draft.

Both train on the task's worked answers and are cached in the run.

GRPO needs a policy that already gets some answers right (a group whose samples all score
0 has zero advantage and teaches nothing). The result is cached under
`<run_dir>/warmstart/` (or `trainer.warmstart_dir`, which runs may share) with the settings
that produced it, so the next run with the same settings reuses it instead of training again.
A cache is immutable once written: a run with other settings is refused before it trains,
never allowed to overwrite it, and a cache appears in one rename, so a run killed while
writing it leaves none.

The toy world's warm starts (no `policy.path`: small models, minutes of CPU) are also kept once per
machine, under `$SPECTRAIN_CACHE/warmstart/<digest of the settings>` (default ~/.cache/spectrain):
a run whose own cache is empty copies a stored one with the same settings instead of training
again, and a run that trained one stores a copy. `SPECTRAIN_WARMSTART_STORE=0` turns that off.

The draft warm-up trains the draft on the warm-started policy's own teacher-forced forward
(the same TTT loss as online co-training), so speculation is alive from the first rollout;
it is cached in `<warmstart>/draft` the same way.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from spectrain import console
from spectrain.batch import RolloutBatch, build_rollout_batch
from spectrain.config import describe_differences
from spectrain.config.loading import cache_home
from spectrain.errors import ConfigError, NonFiniteError, RunDirError
from spectrain.machine import resolve_device
from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft, export_draft, load_draft
from spectrain.models.hf_io import load_pretrained, read_tensor, save_pretrained
from spectrain.models.llama import LlamaForCausalLM
from spectrain.parallel.plan import draft_inputs_from, ttt_valid_tokens
from spectrain.rollout.engine import Completion
from spectrain.tasks.draft_vocab import completion_token_ids, vocab_mapping_from_token_ids
from spectrain.train.draft_update import draft_optimizer, draft_update, warn_if_skipped
from spectrain.train.grpo import token_logprobs
from spectrain.train.inputs import model_identity


def examples_to_batch(examples, tokenizer) -> RolloutBatch:
    """Teacher-forced batch: prompt + worked answer, loss on the answer tokens only.

    An example without a worked target (a JSONL row with only "prompt" and "answer") is
    trained on its bare answer, which the reward accepts as a whole completion.
    """
    completions = [Completion(i, tokenizer.encode_prompt(ex.prompt),
                              tokenizer.encode(ex.target or ex.answer, add_bos=False) + [tokenizer.eos_id],
                              [], True)
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
    # disable=None: a bar on a terminal only (in a log its redraws pile up on one line)
    bar = tqdm(range(steps), desc="warm-start SFT", disable=None if progress else True, dynamic_ncols=True)
    device = next(policy.parameters()).device
    for step in bar:
        loss = sft_loss(policy, examples_to_batch(task.sample(batch_size, rng), tokenizer).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        if not (math.isfinite(loss.item()) and math.isfinite(grad_norm.item())):  # never cache a NaN policy
            raise NonFiniteError(f"warm-start SFT step {step + 1} of {steps}: the loss ({loss.item():.4g}) or the "
                                 f"gradient norm ({grad_norm.item():.4g}) is not finite; nothing was cached. Lower "
                                 f"sft.lr, check the prompt files' targets, or set sft.enabled=false")
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    log_without_bar(progress, "warm-start SFT", losses)
    return losses


@contextmanager
def on_device(device: torch.device, *modules: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """Train `modules` on `device` (the run's accelerator: an 8B SFT on the host's CPU would take days), then bring
    them and `optimizer`'s state back to the CPU, where the trainer exports them and Lightning places them."""
    for module in modules:
        module.to(device)
    try:
        yield
    finally:
        for module in modules:
            module.to("cpu")
        for state in (optimizer.state.values() if optimizer is not None else ()):
            for name, value in state.items():
                if torch.is_tensor(value):
                    state[name] = value.cpu()


def log_without_bar(progress: bool, what: str, losses: list[float]) -> None:
    """Off a terminal the bar is off: one line says what it would have shown at its end."""
    if progress and losses and not console.interactive():
        print(f"[spectrain] {what}: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)


CACHE_META = "meta.json"  # written last: a directory without it is no cache
_KEY_NAMES = {"seed": "trainer.seed"}  # cache-key entries whose config key is spelled differently


def sft_enabled(config) -> bool:
    """`sft.enabled`; null means on for the toy policy (it starts random) and off for a pretrained `policy.path`."""
    return config.policy.path is None if config.sft.enabled is None else config.sft.enabled


# how the policy runs, not what the warm start trains: the SFT runs on the default torch ops without
# checkpointing, and backends agree to rounding
RUNTIME_POLICY_KEYS = ("attention_backend", "activation_checkpointing", "logprob_chunk_tokens")


def policy_cache_key(config) -> dict:
    """Everything the SFT'd policy depends on: for a pretrained policy also its identity (path and config hash),
    so another checkpoint at the same path never reuses the cache; for prompt files, the data and tokenizer keys."""
    policy = {k: v for k, v in asdict(config.policy).items() if k not in RUNTIME_POLICY_KEYS}
    key = {"policy": policy, "toy": asdict(config.toy), "task": asdict(config.task), "sft": asdict(config.sft),
           "seed": config.trainer.seed}
    if config.task.name == "files":
        key.update(data=asdict(config.data), tokenizer=asdict(config.tokenizer))
    if config.policy.path is not None:
        key["model"] = model_identity(config)
    return key


def cached(cache: Path, key: dict, what: str) -> bool:
    """Whether `cache` holds the `what` trained under `key`; False when there is none yet.

    Refuses (RunDirError) a cache trained under another key and a directory that holds
    something else, so that neither is ever overwritten.
    """
    meta = cache / CACHE_META
    if not meta.is_file():
        if cache.exists() and (not cache.is_dir() or any(cache.iterdir())):
            raise RunDirError(f"{cache} exists but holds no {what} ({CACHE_META} is missing); refusing to write into "
                              f"it. Set trainer.warmstart_dir to another directory, or remove {cache} if it is what "
                              f"is left of a killed run.")
        return False
    try:
        saved = json.loads(meta.read_text())["settings"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RunDirError(f"{meta} cannot be read ({type(exc).__name__}: {exc}); set trainer.warmstart_dir to "
                          f"another directory, or remove {cache} to train the {what} again there.") from exc
    common = set(saved) & set(key) if isinstance(saved, dict) else set()  # sections (data: files only) aside
    layout = (_key_paths({k: saved[k] for k in common}) ^ _key_paths({k: key[k] for k in common})
              if isinstance(saved, dict) else {"(not a mapping)"})
    if layout:  # recorded by another version: its keys are not translated
        raise RunDirError(f"{cache} holds a {what} keyed in another layout than this spectrain's (keys only there "
                          f"or only here: {', '.join(sorted(layout)[:5])}{', ...' if len(layout) > 5 else ''}); set "
                          f"trainer.warmstart_dir to another directory, or remove {cache} to train the {what} again.")
    if saved != key:
        changed = describe_differences({_KEY_NAMES.get(k, k): v for k, v in saved.items()},
                                       {_KEY_NAMES.get(k, k): v for k, v in key.items()})
        raise RunDirError(f"{cache} holds a {what} trained with other settings ({changed}); a "
                          f"warm-start cache is never overwritten. Set trainer.warmstart_dir to another directory "
                          f"for these settings, or use the settings it was trained with.")
    return True


def _key_paths(tree: dict, prefix: str = "") -> set[str]:
    """The dotted keys of a cache key, down to the config sections it records (their mappings' own keys excluded:
    data.train_files may be a list, tokenizer.chat_template_kwargs a mapping)."""
    keys = set()
    for name, value in tree.items():
        nested = isinstance(value, dict) and not prefix  # a section: policy, toy, task, sft, data, ...
        keys |= _key_paths(value, f"{name}.") if nested else {f"{prefix}{name}"}
    return keys


@contextmanager
def writing_cache(cache: Path):
    """A scratch directory beside `cache` that becomes `cache` in one rename when the block succeeds."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{cache.name}.partial-", dir=cache.parent))
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        os.rename(scratch, cache)  # atomic; onto a missing or empty directory only, so nothing is overwritten
    except OSError as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        raise RunDirError(f"could not move the new {cache.name} into {cache} ({exc}); if another run wrote it "
                          f"meanwhile, run again to reuse it, or set trainer.warmstart_dir to another "
                          f"directory.") from exc


STORE_ENV = "SPECTRAIN_WARMSTART_STORE"  # 0: no machine-wide copy of the toy world's warm starts


def machine_store(config, key: dict) -> Path | None:
    """Where this machine keeps the warm start trained under `key` for every run; None for a `policy.path`
    checkpoint (its weights are the user's to place: `trainer.warmstart_dir`) or with the store turned off."""
    if config.policy.path is not None or os.environ.get(STORE_ENV, "1") == "0":
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_home() / "warmstart" / digest


def copy_from_store(store: Path | None, cache: Path, what: str) -> bool:
    """Fill the empty `cache` from the machine's stored copy; whether there was one."""
    if store is None or not (store / CACHE_META).is_file():
        return False
    with writing_cache(cache) as scratch:
        shutil.copytree(store, scratch, dirs_exist_ok=True)
    print(f"[spectrain] {what}: this machine's copy with the same settings ({store}), not trained again", flush=True)
    return True


def copy_to_store(cache: Path, store: Path | None) -> None:
    """Keep a copy of the new `cache` (without the draft beside a policy) for the machine's next runs. Best effort: a
    store another run filled meanwhile, or one that cannot be written, leaves the run's own cache as it is."""
    if store is None or (store / CACHE_META).is_file():
        return
    try:
        with writing_cache(store) as scratch:
            shutil.copytree(cache, scratch, dirs_exist_ok=True, ignore=lambda d, names: ["draft"] if d == str(cache)
                            else [])
    except (OSError, RunDirError):
        pass


def warm_start_policy(config, policy: LlamaForCausalLM, task, tokenizer, cache_root: Path,
                      progress: bool = True) -> tuple[LlamaForCausalLM, dict]:
    """Return the SFT'd policy, training it only if no matching cache exists yet.

    A pretrained policy without SFT is its own warm start: nothing is trained or cached.
    """
    if config.policy.path is not None and not sft_enabled(config):
        return policy, {}
    cache, key = cache_root, policy_cache_key(config)
    store = machine_store(config, key)
    if cached(cache, key, "warm-start policy") or copy_from_store(store, cache, "warm-start policy"):
        return load_pretrained(cache / "policy"), json.loads((cache / CACHE_META).read_text())
    losses = []
    if sft_enabled(config):
        with on_device(resolve_device(config.trainer.accelerator), policy):
            losses = train_sft(policy, task, tokenizer, config.sft.steps, config.sft.batch_size, config.sft.lr,
                               seed=config.trainer.seed, progress=progress)
    meta = {"settings": key, "final_loss": losses[-1] if losses else None, "steps": len(losses)}
    with writing_cache(cache) as scratch:
        save_pretrained(policy, scratch / "policy", tokenizer=tokenizer)
        (scratch / CACHE_META).write_text(json.dumps(meta, indent=2))
    copy_to_store(cache, store)
    return policy, meta


def build_draft(config, policy: LlamaForCausalLM, source, tokenizer) -> Eagle3Draft:
    """The draft to warm up: `draft.path` (an EAGLE-3 directory in vLLM's or SpecForge's layout), or a new one sized
    like one policy layer whose vocabulary is the `draft.draft_vocab_size` most frequent tokens of the train data."""
    d = config.draft
    if d.init == "path":
        # a draft trained for the checkpoint copied its embedding, before any SFT here moved the policy's
        embeddings = (read_tensor(config.policy.path, "model.embed_tokens.weight") if config.policy.path is not None
                      else policy.model.embed_tokens.weight)
        try:  # a draft that does not fit the policy is already a ConfigError naming draft.path
            return load_draft(d.path, policy_cfg=policy.cfg, policy_embeddings=embeddings)
        except OSError as exc:
            raise ConfigError(f"draft.path: cannot read {d.path} ({exc}); give an EAGLE-3 directory (config.json "
                              f"and model.safetensors) in vLLM's or SpecForge's layout") from exc
    try:
        cfg = Eagle3Config.from_policy(policy.cfg, draft_vocab_size=d.draft_vocab_size,
                                       tap_layers=tuple(d.tap_layers) if d.tap_layers is not None else None)
    except ValueError as exc:
        key = "draft.tap_layers" if "tap_layers" in str(exc) else "draft.draft_vocab_size"
        raise ConfigError(f"{key}: {exc}") from exc
    torch.manual_seed(config.trainer.seed + 1)
    draft = Eagle3Draft(cfg)
    if cfg.draft_vocab_size < cfg.vocab_size:
        # the stop ids always stay, so a draft can propose the end of a completion (its coverage of the completions
        # was warned about in check_inputs: inputs.check_draft_vocab)
        draft.set_vocab_mapping(*vocab_mapping_from_token_ids(completion_token_ids(source, tokenizer), cfg.vocab_size,
                                                              cfg.draft_vocab_size, always_include=tokenizer.stop_ids))
    return draft


def warm_up_draft(draft: Eagle3Draft, policy: LlamaForCausalLM, source, tokenizer, steps: int,
                  batch_size: int, optimizer: torch.optim.Optimizer, ttt_passes: int, pass_decay: float, seed: int,
                  progress: bool = True, loss_kernel: str = "auto") -> list[float]:
    """Offline TTT on teacher-forced task data, one `draft_update` per batch; the policy is frozen (no grad).

    Gradients are clipped at 1.0, a constant rather than `draft.grad_clip`, so that the cached
    warm-up does not depend on a key its cache is not keyed on.
    """
    rng = random.Random(f"draft-warmup:{seed}")
    losses = []
    bar = tqdm(range(steps), desc="draft warm-up", disable=None if progress else True, dynamic_ncols=True)
    device = next(policy.parameters()).device
    for i in bar:
        batch = examples_to_batch(source.sample(batch_size, rng), tokenizer).to(device)
        with torch.no_grad():
            out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=draft.cfg.tap_layers)
        taps = draft_inputs_from(out, batch, policy.attention_ops, None, ttt_valid_tokens(batch))
        update = draft_update(draft, optimizer, [taps], ttt_passes=ttt_passes, pass_decay=pass_decay, grad_clip=1.0,
                              loss_kernel=loss_kernel)
        warn_if_skipped(update, f"draft warm-up update {i + 1} of {steps}")
        losses.append(update.loss)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=f"{update.metrics.accuracy[0].item():.2f}")
    log_without_bar(progress, "draft warm-up", losses)
    return losses


def draft_cache_key(config) -> dict:
    """Everything the warmed-up draft depends on.

    Not `draft.mode` (co-trained / frozen) nor `draft.num_speculative_tokens`: they do not
    change the warm-up, so runs that differ only in them share it.
    """
    draft_settings = {k: v for k, v in asdict(config.draft).items()
                      if k in ("init", "path", "draft_vocab_size", "tap_layers", "warmup_lr", "warmup_steps",
                               "ttt_passes", "pass_decay")}
    return {"draft": draft_settings, **policy_cache_key(config)}


WARMUP_OPTIMIZER = "optimizer.pt"  # the warm-up's AdamW state, beside the draft it trained


def warmup_optimizer_state(cache_root: Path) -> dict | None:
    """The draft warm-up's AdamW state (None without a warm-up): online co-training continues from its moments."""
    path = cache_root / "draft" / WARMUP_OPTIMIZER
    return torch.load(path, weights_only=True) if path.is_file() else None


def build_and_warm_up_draft(config, policy: LlamaForCausalLM, source, tokenizer, cache_root: Path) -> Eagle3Draft:
    """The draft from `<cache_root>/draft` if it was warmed up under these settings, else built (and cached)."""
    d = config.draft
    cache, key = cache_root / "draft", draft_cache_key(config)
    store = machine_store(config, key)
    if cached(cache, key, "draft warm-up") or copy_from_store(store, cache, "draft warm-up"):
        return load_draft(cache)
    draft = build_draft(config, policy, source, tokenizer)
    losses, optimizer = [], draft_optimizer(draft, d.warmup_lr)
    if d.warmup_steps > 0:
        with on_device(resolve_device(config.trainer.accelerator), draft, policy, optimizer=optimizer):
            losses = warm_up_draft(draft, policy, source, tokenizer, d.warmup_steps, config.sft.batch_size,
                                   optimizer, d.ttt_passes, d.pass_decay, config.trainer.seed,
                                   config.trainer.progress_bar, loss_kernel=d.loss_kernel)
    with writing_cache(cache) as scratch:
        export_draft(draft, scratch, policy.cfg)
        if losses:
            torch.save(optimizer.state_dict(), scratch / WARMUP_OPTIMIZER)
        (scratch / CACHE_META).write_text(json.dumps({"settings": key, "final_loss": losses[-1] if losses else None},
                                                     indent=2))
    copy_to_store(cache, store)
    return draft

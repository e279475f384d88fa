"""Structured configs and recipe loading.

A recipe is an omegaconf YAML file. `defaults: [name, ...]` lists recipes it inherits
from (resolved beside it, then among the packaged recipes), merged in order, then the file
itself, then `key=value` overrides from the command line. Everything is merged onto the
dataclasses below, so unknown keys and wrong types fail at load time, and `validate`
rejects impossible values before any work starts. Every error names the key and the fix.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spectrain.errors import ConfigError
from spectrain.rl.rewards import REWARD_FNS

DEFAULT_RECIPE = "tiny_cpu"


@dataclass
class PolicyConfig:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 128


@dataclass
class TaskConfig:
    name: str = "arithmetic"  # arithmetic | jsonl
    digits: int = 2
    operands: int = 2
    path: str | None = None  # JSONL with {"prompt", "answer"} rows when name == jsonl
    on_bad_row: str = "skip"  # skip | error
    reward: str = "exact_answer"
    partial_credit: float = 0.0  # reward share for a wrong answer with some right digits


@dataclass
class SFTConfig:
    enabled: bool = True
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    eval_prompts: int = 128


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int = 128
    kv_cache_gib: float = 1.0
    eval_prompts: int = 128
    eval_samples: int = 8  # sampled completions per held-out prompt
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM arguments (e.g. num_gpu_blocks_override)


@dataclass
class GRPOConfig:
    lr: float = 3e-5  # measured: 5e-4 collapses the tiny policy within 5 steps, 3e-5 improves it
    clip_eps: float = 0.2
    kl_beta: float = 0.0  # weight of KL(policy || warm-start policy); needs cp=1 and pp=1
    minibatches: int = 1  # optimizer updates per rollout pass, each on a shuffled share of the documents
    epochs: int = 1  # passes over each rollout; updates after the first are clipped against the rollout
    adv_eps: float = 1e-4
    grad_clip: float = 1.0
    weight_decay: float = 0.0


@dataclass
class DraftConfig:
    mode: str = "cotrained"  # cotrained | frozen | none
    num_speculative_tokens: int = 3
    ttt_steps: int = 3
    aux_layer_ids: list[int] | None = None  # None: vLLM's (2, n//2, n-3); (1, n//2, n-1) if those repeat
    lr: float = 3e-3
    grad_clip: float = 1.0
    every_n_steps: int = 1
    pass_decay: float = 0.8
    warmup_steps: int = 0  # offline draft warm-up on the warm-started policy before RL
    check_alive: bool = True  # after each draft sync: acceptance must not collapse (see `collapse_ratio`)
    collapse_ratio: float = 0.5  # acceptance gain (length - 1) below this share of the recent median: check the drafter
    on_dead: str = "raise"  # raise | disable: a lost drafter stops the run, or the run goes on without speculation


PP_STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}  # pipeline schedules and their stages per rank


@dataclass
class ParallelConfig:
    dp: int = 1
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1F1B"
    microbatches: int = 2


@dataclass
class BanditConfig:
    epsilon: float = 0.1
    window: int = 300
    arms: list[int] = field(default_factory=lambda: [1, 2, 3, 4])  # num_speculative_tokens per arm, <= draft's
    bucket_edges: list[int] = field(default_factory=lambda: [4, 16, 64])  # batch buckets [1,3], [4,15], ...
    min_plays: int = 1  # plays per (bucket, arm) before the arm counts as tried


@dataclass
class LongTailConfig:
    enabled: bool = False  # train the draft while the rollout's long tail leaves capacity idle
    threshold: int = 4
    max_steps: int = 4


@dataclass
class SpeculationConfig:
    mode: str = "fixed"  # fixed | concurrency | bandit
    verify_budget: int | None = None  # from `spectrain calibrate`; None reads the run's calibration
    bandit: BanditConfig = field(default_factory=BanditConfig)
    long_tail: LongTailConfig = field(default_factory=LongTailConfig)


@dataclass
class CallbackConfig:
    target: str = MISSING  # import path of a lightning Callback class
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    max_steps: int = 20
    seed: int = 0
    run_dir: str = "runs/tiny_cpu"
    warmstart_dir: str | None = None  # SFT policy + draft warm-up cache; None: <run_dir>/warmstart
    resume: str = "auto"  # auto: resume an existing run dir | never: refuse an existing one
    logger: str = "csv"  # csv | tensorboard
    log_every_n_steps: int = 1
    eval_every_n_steps: int = 10  # held-out reward every N steps (0: only before and after training)
    checkpoint_every_n_steps: int = 5
    progress_bar: bool = True
    callbacks: list[CallbackConfig] = field(default_factory=list)


VLLM_KWARGS_SET_BY_SPECTRAIN = ("model", "dtype", "max_model_len", "seed", "enforce_eager", "enable_prefix_caching",
                                "disable_log_stats", "kv_cache_memory_bytes", "speculative_config")


@dataclass
class SyncConfig:
    on_mismatch: str = "raise"  # raise | warn: an engine that does not serve the synced weights stops the run, or is re-synced
    logprob_tolerance: float | None = None  # mean |trainer - engine| logprob of a rollout; None: 1e-3 float32, 5e-2 bf16
    weight_rtol: float | None = None  # relative error of the weight probe; None: 1e-4 float32, 1e-2 bf16


@dataclass
class SpecTrainConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def packaged_recipe_dir() -> Path:
    return Path(str(resources.files("spectrain.recipes")))


def resolve_recipe(name_or_path: str, relative_to: Path | None = None) -> Path:
    """A recipe by path, by name beside the including file, or by packaged name."""
    candidates = [Path(name_or_path)]
    stem = name_or_path if name_or_path.endswith((".yaml", ".yml")) else f"{name_or_path}.yaml"
    if relative_to is not None:
        candidates.append(relative_to / stem)
    candidates.append(packaged_recipe_dir() / stem)
    for c in candidates:
        if c.is_file():
            return c
    available = sorted(p.stem for p in packaged_recipe_dir().glob("*.yaml"))
    raise ConfigError(f"recipe '{name_or_path}' not found (looked at {[str(c) for c in candidates]}); "
                      f"pass a YAML path or one of the packaged recipes: {available}")


def _read_yaml(path: Path) -> DictConfig:
    try:
        node = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and friends: the message already says where
        raise ConfigError(f"recipe {path} is not valid YAML: {exc}") from exc
    if not isinstance(node, DictConfig):
        raise ConfigError(f"recipe {path} must be a mapping of sections (policy:, rollout:, ...), not a list")
    return node


def _load_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> list[DictConfig]:
    """The recipe's inheritance chain, parents first."""
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in (*seen, path.resolve()))
        raise ConfigError(f"recipe inheritance loops: {chain}; remove one of the defaults entries")
    node = _read_yaml(path)
    defaults = node.pop("defaults", [])
    if isinstance(defaults, str):
        defaults = [defaults]
    layers: list[DictConfig] = []
    for parent in defaults:
        layers += _load_with_defaults(resolve_recipe(str(parent), path.parent), (*seen, path.resolve()))
    return layers + [node]


def _merge(base: DictConfig, layer: DictConfig, origin: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or _mistyped_section(base, layer)
        raise ConfigError(f"{origin}: bad value for '{key}': {_merge_reason(exc)}. "
                          f"Check the key's spelling and type against spectrain/config.py "
                          f"(`spectrain show-config` prints every key with its default)") from exc


def _mistyped_section(base: DictConfig, layer: DictConfig) -> str:
    """The top-level key the layer gives a plain value where the schema has a section (omegaconf names none)."""
    return next((str(k) for k in layer if isinstance(base.get(k), DictConfig) and not isinstance(layer[k], DictConfig)),
                "?")


def _merge_reason(exc: OmegaConfBaseException) -> str:
    """omegaconf's reason, in the recipe's terms where it speaks of its own node classes."""
    text = _first_line(exc)
    if "is not a ListConfig" in text:
        return "expected a list, e.g. [1, 2, 3] (quoted in the shell: 'key=[1,2,3]')"
    if "is not a subclass of" in text:
        return "this is a section of keys, not a single value (set its keys, e.g. section.key=value)"
    return text


def _leaf_keys(node: DictConfig, prefix: str = "") -> set[str]:
    keys = set()
    for key in node.keys():
        full = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            continue
        value = node[key]
        keys |= _leaf_keys(value, f"{full}.") if isinstance(value, DictConfig) else {full}
    return keys


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]


def load_config(recipe: str | None = None, overrides: list[str] | None = None) -> SpecTrainConfig:
    """Load a recipe (default: the embedded tiny CPU recipe), apply overrides, validate."""
    cfg = OmegaConf.structured(SpecTrainConfig)
    path = resolve_recipe(recipe or DEFAULT_RECIPE)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value, e.g. trainer.max_steps=10")
    try:
        layers = _load_with_defaults(path) + [OmegaConf.from_dotlist(list(overrides or []))]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"command-line overrides {overrides} cannot be parsed: {_first_line(exc)}") from exc
    required: set[str] = set()
    for i, layer in enumerate(layers):
        origin = f"recipe {path}" if i < len(layers) - 1 else "command-line override"
        cfg = _merge(cfg, layer, origin)
        # omegaconf keeps the old value when merging `???` onto it, so track required keys per layer
        marked = set(OmegaConf.missing_keys(layer))
        required = (required - _leaf_keys(layer)) | marked
    missing = sorted(required | set(OmegaConf.missing_keys(cfg)))
    if missing:
        raise ConfigError(f"required values are missing (???): {missing}; set them in the recipe "
                          f"or on the command line, e.g. {missing[0]}=...")
    config: SpecTrainConfig = OmegaConf.to_object(cfg)
    validate(config)
    return config


def to_yaml(config: SpecTrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for name, value in tree.items():
        flat.update(_flat(value, f"{prefix}{name}.") if isinstance(value, dict) else {f"{prefix}{name}": value})
    return flat


def describe_differences(before: dict, now: dict) -> str:
    """`key: A before, B now` for every dotted key whose value differs, for refusal messages."""
    old, new = _flat(before), _flat(now)
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k, "(absent)") != new.get(k, "(absent)"))
    return ", ".join(f"{k}: {old.get(k, '(absent)')} before, {new.get(k, '(absent)')} now" for k in keys)

def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _one_of(value: str, key: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, key, f"'{value}' is not one of {list(allowed)}")


def _check_pipeline(c: SpecTrainConfig) -> None:
    """What `PipelinePlan` and torch's schedules would reject mid-run, rejected at load time."""
    p, par = c.policy, c.parallel
    stages = par.pp * PP_STAGES_PER_RANK[par.pp_schedule]
    per_rank = "" if stages == par.pp else f" ({par.pp_schedule} runs {stages // par.pp} per rank)"
    _require(stages <= p.num_hidden_layers, "parallel.pp",
             f"{stages} pipeline stages{per_rank} but the policy has only {p.num_hidden_layers} layers; lower "
             f"parallel.pp, raise policy.num_hidden_layers" + (" or use pp_schedule=1F1B" if per_rank else ""))
    _require(par.pp_schedule != "1F1B" or par.microbatches >= stages, "parallel.microbatches",
             f"1F1B needs at least one microbatch per stage ({stages}), got {par.microbatches}; raise "
             f"parallel.microbatches to >= {stages} or use parallel.pp_schedule=GPipe")
    rounds = max(1, par.microbatches // par.pp)
    _require(par.pp_schedule != "Interleaved1F1B" or par.microbatches % rounds == 0, "parallel.microbatches",
             f"Interleaved1F1B runs microbatches in rounds of parallel.pp={par.pp}: {par.microbatches} is not a "
             f"multiple of its {rounds} rounds; use a multiple of {par.pp}")
    _require(not p.tie_word_embeddings, "policy.tie_word_embeddings",
             "tied embeddings would put lm_head.weight on the first and the last stage; set it false or parallel.pp=1")
    docs = c.rollout.prompts_per_step * c.rollout.group_size // c.grpo.minibatches  # the smallest update's
    _require(docs >= par.dp * par.microbatches, "parallel.microbatches",
             f"each of parallel.dp={par.dp} ranks cuts its documents into {par.microbatches} microbatches, but an "
             f"update has only {docs} (rollout.prompts_per_step x group_size / grpo.minibatches); lower "
             f"parallel.microbatches or grpo.minibatches, or send more")


# sizes and counts that anything downstream divides by, loops over or allocates from
_AT_LEAST_ONE = (
    "policy.hidden_size", "policy.intermediate_size", "policy.num_hidden_layers", "policy.num_attention_heads",
    "policy.num_key_value_heads", "policy.max_position_embeddings", "task.digits", "sft.batch_size",
    "rollout.prompts_per_step", "rollout.max_new_tokens", "rollout.max_model_len", "rollout.eval_prompts",
    "grpo.minibatches", "grpo.epochs", "draft.num_speculative_tokens", "draft.ttt_steps", "draft.every_n_steps",
    "parallel.dp", "parallel.cp", "parallel.pp", "parallel.microbatches", "speculation.bandit.window",
    "speculation.bandit.min_plays", "speculation.long_tail.threshold", "trainer.log_every_n_steps",
    "trainer.checkpoint_every_n_steps",
)
_AT_LEAST_ZERO = ("draft.warmup_steps", "grpo.kl_beta", "grpo.weight_decay", "speculation.long_tail.max_steps",
                  "trainer.max_steps", "trainer.eval_every_n_steps")
_POSITIVE = ("sft.lr", "grpo.lr", "grpo.clip_eps", "grpo.adv_eps", "grpo.grad_clip", "draft.lr", "draft.grad_clip")
_MAX_SEED = 2**32 - 1  # Lightning's seed_everything accepts 0..2^32-1


def _value(c: SpecTrainConfig, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), c)


def _check_ranges(c: SpecTrainConfig) -> None:
    """The plain bounds, first: later checks divide by these values."""
    for key in _AT_LEAST_ONE:
        _require(_value(c, key) >= 1, key, f"is {_value(c, key)}; it must be >= 1")
    for key in _AT_LEAST_ZERO:
        _require(_value(c, key) >= 0, key, f"is {_value(c, key)}; it must be >= 0")
    for key in _POSITIVE:
        _require(_value(c, key) > 0, key, f"is {_value(c, key)}; it must be > 0 (e.g. the default "
                                          f"{_value(SpecTrainConfig(), key)})")


def _check_policy(c: SpecTrainConfig) -> None:
    p = c.policy
    _require(p.num_attention_heads % p.num_key_value_heads == 0, "policy.num_key_value_heads",
             f"num_attention_heads={p.num_attention_heads} must be a multiple of it")
    _require(p.hidden_size % p.num_attention_heads == 0, "policy.hidden_size",
             f"must be divisible by num_attention_heads={p.num_attention_heads}")
    head_dim = p.hidden_size // p.num_attention_heads
    _require(head_dim % 2 == 0, "policy.hidden_size", f"hidden_size / num_attention_heads = {head_dim} must be even "
             f"(rotary embeddings rotate pairs of dimensions)")
    _require(c.rollout.max_model_len <= p.max_position_embeddings, "rollout.max_model_len",
             f"{c.rollout.max_model_len} exceeds policy.max_position_embeddings={p.max_position_embeddings}; "
             f"raise the latter or lower the former")


def _check_task(c: SpecTrainConfig) -> None:
    t = c.task
    _one_of(t.name, "task.name", ("arithmetic", "jsonl"))
    _one_of(t.on_bad_row, "task.on_bad_row", ("skip", "error"))
    _require(t.name != "jsonl" or bool(t.path), "task.path", "task.name=jsonl needs task.path=/path/to/prompts.jsonl")
    _require(t.operands >= 2, "task.operands", f"is {t.operands}; an arithmetic prompt needs >= 2 operands")
    _one_of(t.reward, "task.reward", tuple(sorted(REWARD_FNS)))
    _require(0 <= t.partial_credit < 1, "task.partial_credit",
             f"is {t.partial_credit}; it must be in [0, 1): a wrong answer must score below a right one")
    _require(not c.sft.enabled or c.sft.steps >= 1, "sft.steps",
             f"is {c.sft.steps}; it must be >= 1 (set sft.enabled=false to skip the warm start)")


def _check_rollout(c: SpecTrainConfig) -> None:
    r = c.rollout
    _require(r.group_size >= 2, "rollout.group_size",
             f"is {r.group_size}; GRPO normalises rewards within a group, so it needs >= 2 samples per prompt")
    _require(r.eval_samples >= 2, "rollout.eval_samples",
             f"is {r.eval_samples}; the held-out standard error needs >= 2 samples per prompt")
    _require(r.temperature > 0, "rollout.temperature",
             f"is {r.temperature}; GRPO needs sampling (greedy decoding gives a group identical completions and "
             f"so no advantage): use a temperature > 0, e.g. 1.0")
    _require(0 < r.top_p <= 1, "rollout.top_p", f"is {r.top_p}; it must be in (0, 1]")
    _require(r.kv_cache_gib > 0, "rollout.kv_cache_gib",
             f"is {r.kv_cache_gib}; give the vLLM KV cache size in GiB, > 0 (fractions are honoured, e.g. 0.5)")
    managed = sorted(set(r.vllm_kwargs) & set(VLLM_KWARGS_SET_BY_SPECTRAIN))
    _require(not managed, "rollout.vllm_kwargs", f"sets {managed}, which spectrain sets itself: use rollout.max_model_len, "
             f"rollout.kv_cache_gib, draft.* and trainer.seed instead, and drop them from rollout.vllm_kwargs")


def _check_grpo(c: SpecTrainConfig) -> None:
    g, r, par = c.grpo, c.rollout, c.parallel
    _require(g.kl_beta == 0 or (par.cp == 1 and par.pp == 1), "grpo.kl_beta",
             "the KL term needs whole documents on one rank: set parallel.cp=1 and parallel.pp=1, or grpo.kl_beta=0")
    docs = r.prompts_per_step * r.group_size
    _require(g.minibatches * par.dp <= docs, "grpo.minibatches",
             f"times parallel.dp={par.dp} must be in [1, prompts_per_step * group_size = {docs}]: "
             f"every data-parallel rank needs at least one completion per minibatch")


def _check_draft(c: SpecTrainConfig) -> None:
    d, layers = c.draft, c.policy.num_hidden_layers
    _one_of(d.mode, "draft.mode", ("cotrained", "frozen", "none"))
    _require(0 < d.pass_decay <= 1, "draft.pass_decay", f"is {d.pass_decay}; it must be in (0, 1]")
    if d.aux_layer_ids is not None:
        bad = [i for i in d.aux_layer_ids if not 0 <= i < layers]
        _require(not bad and len(d.aux_layer_ids) == 3, "draft.aux_layer_ids",
                 f"{list(d.aux_layer_ids)} must be 3 layer ids in 0..{layers - 1}, e.g. draft.aux_layer_ids=[0,1,2]")
    elif d.mode != "none":
        _require(layers >= 4, "policy.num_hidden_layers",
                 "EAGLE-3's default aux layers (2, n//2, n-3) need >= 4 layers; set draft.aux_layer_ids")


def _check_parallel(c: SpecTrainConfig) -> None:
    _one_of(c.parallel.pp_schedule, "parallel.pp_schedule", tuple(PP_STAGES_PER_RANK))
    if c.parallel.pp > 1:
        _check_pipeline(c)


def _check_speculation(c: SpecTrainConfig) -> None:
    s, d, par = c.speculation, c.draft, c.parallel
    b = s.bandit
    _one_of(s.mode, "speculation.mode", ("fixed", "concurrency", "bandit"))
    _require(s.verify_budget is None or s.verify_budget >= 1, "speculation.verify_budget",
             f"is {s.verify_budget}; it must be >= 1 tokens, or null to read the run's calibration")
    _require(0 <= b.epsilon <= 1, "speculation.bandit.epsilon", f"is {b.epsilon}; it must be in [0, 1]")
    _require(b.min_plays <= b.window, "speculation.bandit.min_plays",
             f"is {b.min_plays}; it must be <= speculation.bandit.window={b.window}")
    edges = [1, *b.bucket_edges]
    _require(all(lo < hi for lo, hi in zip(edges, edges[1:])), "speculation.bandit.bucket_edges",
             f"{list(b.bucket_edges)} must be strictly increasing batch sizes > 1, e.g. [4, 16, 64]")
    _require(s.mode == "fixed" or d.mode != "none", "speculation.mode",
             f"'{s.mode}' adapts the draft's k, but draft.mode=none; use speculation.mode=fixed")
    if s.mode == "bandit":
        _require(len(b.arms) >= 1 and len(set(b.arms)) == len(b.arms), "speculation.bandit.arms",
                 f"{list(b.arms)} must list one or more distinct k values, e.g. [1, 2, 3]")
        _require(all(0 <= k <= d.num_speculative_tokens for k in b.arms), "speculation.bandit.arms",
                 f"{list(b.arms)} must be in 0..draft.num_speculative_tokens={d.num_speculative_tokens} "
                 f"(the engine's k_max)")
    if s.long_tail.enabled:
        _require(d.mode == "cotrained", "speculation.long_tail.enabled", f"spot training trains the draft, but "
                 f"draft.mode={d.mode}; set draft.mode=cotrained or disable the long tail")
        _require(par.dp * par.cp * par.pp == 1, "speculation.long_tail.enabled",
                 "spot training runs on the rollout process only; use it with parallel.dp=cp=pp=1")


def _check_sync(c: SpecTrainConfig) -> None:
    d = c.draft
    _one_of(d.on_dead, "draft.on_dead", ("raise", "disable"))
    _require(0 < d.collapse_ratio < 1, "draft.collapse_ratio", f"is {d.collapse_ratio}; it must be in (0, 1)")
    _one_of(c.sync.on_mismatch, "sync.on_mismatch", ("raise", "warn"))
    for key in ("logprob_tolerance", "weight_rtol"):
        value = getattr(c.sync, key)
        _require(value is None or value > 0, f"sync.{key}", f"is {value}; it must be > 0 (or null for the dtype's default)")


def _check_trainer(c: SpecTrainConfig) -> None:
    t = c.trainer
    _one_of(t.resume, "trainer.resume", ("auto", "never"))
    _one_of(t.logger, "trainer.logger", ("csv", "tensorboard"))
    _require(0 <= t.seed <= _MAX_SEED, "trainer.seed", f"is {t.seed}; it must be in 0..{_MAX_SEED}")
    _require(bool(t.run_dir.strip()), "trainer.run_dir", "is empty; give the run's directory, e.g. runs/my_run")
    _require(t.warmstart_dir is None or bool(t.warmstart_dir.strip()), "trainer.warmstart_dir",
             "is empty; give a directory, or null for <run_dir>/warmstart")
    _require(t.warmstart_dir is None or Path(t.warmstart_dir).resolve() != Path(t.run_dir).resolve(),
             "trainer.warmstart_dir", "is the run directory itself; use a directory of its own, or null for "
             "<run_dir>/warmstart")
    for i, callback in enumerate(t.callbacks):
        _require("." in callback.target, f"trainer.callbacks[{i}].target",
                 f"'{callback.target}' must be the full import path of a lightning Callback class, "
                 f"e.g. my_pkg.callbacks.MyCallback")


def validate(c: SpecTrainConfig) -> None:
    """Reject impossible values before any work starts; every message names the key and the fix."""
    _check_ranges(c)
    for check in (_check_policy, _check_task, _check_rollout, _check_grpo, _check_draft, _check_parallel,
                  _check_speculation, _check_sync, _check_trainer):
        check(c)

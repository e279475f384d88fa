"""Recipe loading: `defaults:` inheritance, dot-list overrides, required `???` values.

A recipe is an omegaconf YAML file. `defaults: [name, ...]` lists recipes it inherits
from (resolved beside it, then among the packaged recipes), merged in order, then the file
itself, then `key=value` overrides from the command line. Everything is merged onto the
schema's dataclasses, so unknown keys and wrong types fail at load time, and `validate`
rejects impossible values before any work starts. Every error names the key and the fix.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spectrain.config.schema import DEFAULT_RECIPE, SpecTrainConfig
from spectrain.config.validation import validate
from spectrain.errors import ConfigError

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


# keys that were renamed: a recipe that still uses the old name is told the new one
RENAMED_KEYS = {"draft.aux_layer_ids": "draft.tap_layers", "draft.ttt_steps": "draft.ttt_passes",
                "task.path": "data.train_files", "task.on_bad_row": "data.on_bad_row", "task.reward": "reward.name",
                "task.partial_credit": "reward.partial_credit"}
RENAMED_VALUES = {("task.name", "jsonl"): "files"}  # a recorded value under its new name
# keys that were removed: a recipe that still sets one is told why, and what to use instead
REMOVED_KEYS = {"sft.eval_prompts": "nothing ever read it; the held-out evaluation's prompt count is "
                                    "rollout.eval_prompts"}


def upgrade_recorded_keys(settings):
    """`settings` (a config tree an older spectrain recorded, plain or omegaconf) in today's keys: RENAMED_KEYS
    under their new name, REMOVED_KEYS dropped (they never changed what a run trains), so the caches and runs it
    recorded stay valid."""
    for old, new in (*RENAMED_KEYS.items(), *((key, None) for key in REMOVED_KEYS)):
        section, _, name = old.partition(".")
        if name not in (settings.get(section) or {}):
            continue
        value = settings[section].pop(name)
        if new is not None:
            new_section, _, new_name = new.partition(".")
            if new_section not in settings:  # DictConfig.setdefault returns a copy, not the node
                settings[new_section] = {}
            settings[new_section][new_name] = value
    for (key, old_value), new_value in RENAMED_VALUES.items():
        section, _, name = key.partition(".")
        if (settings.get(section) or {}).get(name) == old_value:
            settings[section][name] = new_value
    return settings


def _merge(base: DictConfig, layer: DictConfig, origin: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or _mistyped_section(base, layer)
        if key in RENAMED_KEYS:
            raise ConfigError(f"{origin}: '{key}' was renamed to '{RENAMED_KEYS[key]}' (docs/glossary.md); use the "
                              f"new name") from exc
        if key in REMOVED_KEYS:
            raise ConfigError(f"{origin}: '{key}' was removed: {REMOVED_KEYS[key]}. Delete the key "
                              f"(docs/glossary.md lists renamed and removed keys)") from exc
        raise ConfigError(f"{origin}: bad value for '{key}': {_merge_reason(exc)}. "
                          f"Check the key's spelling and type against spectrain/config/schema.py "
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
        value = node._get_node(key)  # unresolved: interpolations resolve once, in to_object
        keys |= _leaf_keys(value, f"{full}.") if isinstance(value, DictConfig) else {full}
    return keys


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]


ASSET_CACHE_ENV = "SPECTRAIN_CACHE"  # where generated assets go; default ~/.cache/spectrain


def asset_path(name: str) -> str:
    """`${spectrain.asset:hf_tiny/policy}` in a recipe: a file or directory the project generates itself (no hub is
    needed), written once under $SPECTRAIN_CACHE (default ~/.cache/spectrain) and reused after."""
    from spectrain.tasks.hf_tiny import write_hf_tiny_assets

    bundle, _, part = name.partition("/")
    if bundle != "hf_tiny":
        raise ConfigError(f"unknown asset '{name}' in ${{spectrain.asset:...}}; the project generates hf_tiny/policy, "
                          f"hf_tiny/train, hf_tiny/val and hf_tiny/draft")
    root = Path(os.environ.get(ASSET_CACHE_ENV) or Path.home() / ".cache" / "spectrain") / "assets"
    assets = write_hf_tiny_assets(root / bundle)
    paths = {"policy": assets.policy_dir, "train": assets.train_file, "val": assets.val_file,
             "draft": assets.draft_dir}
    if part not in paths:
        raise ConfigError(f"unknown asset '{name}'; hf_tiny has {sorted(paths)}")
    return str(paths[part])


if not OmegaConf.has_resolver("spectrain.asset"):
    OmegaConf.register_resolver("spectrain.asset", asset_path)


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
    try:
        config: SpecTrainConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:  # an interpolation that does not resolve
        reason = _first_line(exc).split("resolving interpolation: ")[-1]
        raise ConfigError(f"{getattr(exc, 'full_key', '?')}: {reason}") from exc
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

"""Recipe loading: `defaults:` inheritance, dot-list overrides, required `???` values.

A recipe is an omegaconf YAML file. `defaults: [name, ...]` lists recipes it inherits
from (resolved beside it, then among the packaged recipes), merged in order, then the file
itself, then `key=value` overrides from the command line. Everything is merged onto the
schema's dataclasses, so unknown keys and wrong types fail at load time; the paths then have
`~` and `$VARS` expanded (`PATH_KEYS`), and `validate` rejects impossible values before any
work starts. Every error names the key and the fix.
"""
from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf._utils import is_structured_config
from omegaconf.errors import OmegaConfBaseException

from spectrain.config.keymap import refusal
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


def _unknown_paths(layer: DictConfig, schema: DictConfig | None, prefix: str = ""):
    """The dotted paths of the values in `layer` that the schema has no key for (the free-form mappings, such as
    rollout.vllm_kwargs, take any key)."""
    for key in layer.keys():
        full = prefix + str(key)
        known = schema is not None and key in schema
        child = layer._get_node(key)
        inner = schema._get_node(key) if schema is not None and known else None
        if known and not (isinstance(inner, DictConfig) and is_structured_config(inner._metadata.object_type)):
            continue  # a schema value, or a free-form mapping
        if isinstance(child, DictConfig) and not (child._is_none() or child._is_missing() or child._is_interpolation()):
            yield from _unknown_paths(child, inner if isinstance(inner, DictConfig) else None, f"{full}.")
        elif not known:
            yield full


def _refuse_known_names(layer: DictConfig, schema: DictConfig, origin: str) -> None:
    """A key spectrain renamed, or verl's or NeMo-RL's name for a spectrain key: refused, naming the key to use."""
    for path in _unknown_paths(layer, schema):
        why = refusal(path)
        if why is not None:
            raise ConfigError(f"{origin}: {why}")


def _merge(base: DictConfig, layer: DictConfig, origin: str) -> DictConfig:
    _refuse_known_names(layer, base, origin)
    try:
        merged = OmegaConf.merge(base, layer)
        assert isinstance(merged, DictConfig)
        return merged
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or _mistyped_section(base, layer)
        reason = _merge_reason(exc)
        literal = re.match(r"Invalid value (.*), expected one of (\[.*\])$", reason)
        if literal:  # a `Literal` key: said as `validate` says it (a recipe named, an override as it is)
            where = f"{origin}: " if origin.startswith("recipe") else ""
            raise ConfigError(f"{where}{key}: {literal.group(1)} is not one of {literal.group(2)}") from exc
        raise ConfigError(f"{origin}: bad value for '{key}': {reason}. "
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
        full = prefix + str(key)
        if OmegaConf.is_missing(node, key):
            continue
        value = node._get_node(key)  # unresolved: interpolations resolve once, in to_object
        keys |= _leaf_keys(value, f"{full}.") if isinstance(value, DictConfig) else {full}
    return keys


def _missing_keys(node: DictConfig | ListConfig, prefix: str = "") -> set[str]:
    """The `???` keys under `node`, found without resolving it: a layer's interpolations may point into others
    (omegaconf's `missing_keys` resolves them, and fails on those)."""
    children: list[tuple[str, Any]]  # omegaconf's nodes
    if isinstance(node, DictConfig):
        children = [(f"{prefix}.{k!s}" if prefix else str(k), node._get_node(k)) for k in node.keys()]
    else:
        children = [(f"{prefix}[{i}]", node._get_node(i)) for i in range(len(node))]
    keys = set()
    for key, child in children:
        if child._is_missing():
            keys.add(key)
        elif isinstance(child, (DictConfig, ListConfig)) and not (child._is_none() or child._is_interpolation()):
            keys |= _missing_keys(child, key)
    return keys


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]


ASSET_CACHE_ENV = "SPECTRAIN_CACHE"  # where generated assets go; default ~/.cache/spectrain


def cache_home() -> Path:
    """$SPECTRAIN_CACHE, default ~/.cache/spectrain: what spectrain generates once per machine and reuses."""
    return Path(os.environ.get(ASSET_CACHE_ENV) or Path.home() / ".cache" / "spectrain")


def asset_path(name: str) -> str:
    """`${spectrain.asset:hf_tiny/policy}` in a recipe: a file or directory the project generates itself (no hub is
    needed), written once under $SPECTRAIN_CACHE (default ~/.cache/spectrain) and reused after."""
    from spectrain.tasks.hf_tiny import write_hf_tiny_assets

    bundle, _, part = name.partition("/")
    if bundle != "hf_tiny":
        raise ConfigError(f"unknown asset '{name}' in ${{spectrain.asset:...}}; the project generates hf_tiny/policy, "
                          f"hf_tiny/train, hf_tiny/val and hf_tiny/draft")
    root = cache_home() / "assets"
    assets = write_hf_tiny_assets(root / bundle)
    paths = {"policy": assets.policy_dir, "train": assets.train_file, "val": assets.val_file,
             "draft": assets.draft_dir}
    if part not in paths:
        raise ConfigError(f"unknown asset '{name}'; hf_tiny has {sorted(paths)}")
    return str(paths[part])


if not OmegaConf.has_resolver("spectrain.asset"):
    OmegaConf.register_resolver("spectrain.asset", asset_path)


# the keys that hold paths: what to give, and what null means there (said when one is empty)
PATH_KEYS = {
    "policy.path": "a Hugging Face model directory, or null for the toy policy",
    "tokenizer.path": "a Hugging Face tokenizer directory, or null for policy.path's own tokenizer",
    "draft.path": "an EAGLE-3 draft directory, or null for a draft started from scratch (draft.init=scratch)",
    "data.train_files": "a .jsonl, .json or .parquet file (or a list of them), or null for task.name=arithmetic",
    "data.val_files": "a .jsonl, .json or .parquet file (or a list of them), or null to hold out prompts drawn "
                      "from the train prompts",
    "reward.path": "a .py file defining reward.function, or null for a built-in reward.name",
    "trainer.run_dir": "the run's directory, e.g. runs/my_run",
    "trainer.warmstart_dir": "a directory, or null for <run_dir>/warmstart",
}
_FILE_LISTS = ("data.train_files", "data.val_files")  # a path or a list of paths
_ENV_VAR = re.compile(r"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))")
_BARE_BRACES = re.compile(r"(?<!\\)\$\{([A-Za-z_]\w*)\}")  # ${NAME}: an environment variable, not a config key


def _check_empty_overrides(overrides: list[str]) -> None:
    """`policy.path=` (and `=~`) would reach omegaconf as null, silently meaning the default: refuse them."""
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.strip()
        if key in PATH_KEYS and value.strip() in ("", "~"):
            what = "is empty" if not value.strip() else "is ~, which YAML reads as null"
            raise ConfigError(f"{key}: {what}; give {PATH_KEYS[key]}")


def _escape_braces(raw):
    return _BARE_BRACES.sub(r"\\${\1}", raw) if isinstance(raw, str) else raw


def _escape_env_braces(layer: DictConfig) -> None:
    """`${HOME}` in a path is the environment variable: escaped in each layer, omegaconf leaves it for
    `_expand_paths` (and still resolves `${spectrain.asset:...}` and dotted keys)."""
    for key in PATH_KEYS:
        section_name, _, name = key.partition(".")
        section = layer._get_node(section_name)
        if not isinstance(section, DictConfig) or section._is_none() or section._is_missing():
            continue
        container = OmegaConf.to_container(section, resolve=False)
        assert isinstance(container, dict)
        raw = container.get(name)
        escaped = [_escape_braces(item) for item in raw] if isinstance(raw, list) else _escape_braces(raw)
        if escaped != raw:
            section[name] = escaped


def _expand_path(key: str, value: object, hint: str) -> str:
    """`~` and `$NAME` / `${NAME}` expanded; an empty path or an unset variable refused."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: is {value!r}, not a path; give {hint}")
    if not value.strip():
        raise ConfigError(f"{key}: is empty; give {hint}")

    def variable(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in os.environ:
            raise ConfigError(f"{key}: {match.group(0)} in {value!r} is not set in the environment; export {name}, "
                              f"or write the path out")
        return os.environ[name]

    return _ENV_VAR.sub(variable, os.path.expanduser(value))


def _expand_paths(config: SpecTrainConfig) -> None:
    """Every path key with `~` and `$VARS` expanded, once, so everything downstream (and show-config) sees the
    paths that are used."""
    for key, hint in PATH_KEYS.items():
        section_name, _, name = key.partition(".")
        section = getattr(config, section_name)
        value = getattr(section, name)
        if value is None:
            continue
        if key in _FILE_LISTS and isinstance(value, list):
            if not value:
                raise ConfigError(f"{key}: is an empty list; give {hint}")
            value = [_expand_path(f"{key}[{i}]", entry, hint) for i, entry in enumerate(value)]
        else:
            value = _expand_path(key, value, hint)
        setattr(section, name, value)


def _keys_without_space(value) -> list[str]:
    """The mapping keys in a parsed override that YAML read from `key:value` (no space after ':') as one key with
    no value."""
    if isinstance(value, dict):
        return [k for k, v in value.items() if isinstance(k, str) and ":" in k and v is None] + [
            k for v in value.values() for k in _keys_without_space(v)]
    if isinstance(value, list):
        return [k for v in value for k in _keys_without_space(v)]
    return []


def _parse_overrides(overrides: list[str]) -> DictConfig:
    """The command line as one layer; an override whose value is not YAML is named (`[a,{]`, `[${X}/a]`), and so is a
    mapping written without a space after ':' (`{a:1}`, which YAML reads as the key 'a:1' with no value)."""
    layer = OmegaConf.create()
    for item in overrides:
        try:
            layer.merge_with_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as exc:
            reason = getattr(exc, "problem", None) or _first_line(exc)
            raise ConfigError(f"override '{item}' cannot be parsed ({reason}); its value is read as YAML: quote "
                              f"items with braces or commas, e.g. 'data.train_files=[\"${{HOME}}/a.jsonl\"]'") from exc
        bad = _keys_without_space(OmegaConf.to_container(layer, resolve=False))  # the earlier items had none
        if bad:
            fixed = item
            for key in bad:
                fixed = fixed.replace(key, key.replace(":", ": ", 1))
            what = "a key without a value" if len(bad) == 1 else "keys without values"
            raise ConfigError(f"override '{item}': YAML reads {', '.join(repr(k) for k in bad)} as {what} (a mapping "
                              f"needs a space after ':'); write '{fixed}'")
    return layer


def _refuse_hydra_prefix(item: str) -> None:
    """Hydra's `+key=value` (add), `++key=value` (force) and `~key` (delete): spectrain has a fixed schema."""
    prefix = "++" if item.startswith("++") else item[0]
    plain = item[len(prefix):]
    raise ConfigError(f"override '{item}': spectrain takes key=value, without Hydra's '{prefix}' prefix (give "
                      f"'{plain}'); keys cannot be added or deleted: every key is in the schema "
                      f"(spectrain/config/schema.py; `spectrain show-config` prints them all) and unknown keys "
                      f"are refused. To add a callback, set the list: "
                      f"'trainer.callbacks=[{{target: my_pkg.MyCallback, args: {{}}}}]' (docs/cotraining.md)")


def load_config(recipe: str | None = None, overrides: list[str] | None = None) -> SpecTrainConfig:
    """Load a recipe (default: the embedded tiny CPU recipe), apply overrides, expand the paths, validate."""
    cfg = OmegaConf.structured(SpecTrainConfig)
    path = resolve_recipe(recipe or DEFAULT_RECIPE)
    for item in overrides or []:
        if item.startswith(("+", "~")):
            _refuse_hydra_prefix(item)
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value, e.g. trainer.max_steps=10")
    _check_empty_overrides(list(overrides or []))
    layers = _load_with_defaults(path) + [_parse_overrides(list(overrides or []))]
    required: set[str] = set()
    for i, layer in enumerate(layers):
        origin = f"recipe {path}" if i < len(layers) - 1 else "command-line override"
        _escape_env_braces(layer)
        cfg = _merge(cfg, layer, origin)
        # omegaconf keeps the old value when merging `???` onto it, so track required keys per layer
        required = (required - _leaf_keys(layer)) | _missing_keys(layer)
    missing = sorted(required | _missing_keys(cfg))
    if missing:
        raise ConfigError(f"required values are missing (???): {missing}; set them in the recipe "
                          f"or on the command line, e.g. {missing[0]}=...")
    try:
        config = cast(SpecTrainConfig, OmegaConf.to_object(cfg))
    except OmegaConfBaseException as exc:  # an interpolation that does not resolve
        reason = _first_line(exc).split("resolving interpolation: ")[-1]
        raise ConfigError(f"{getattr(exc, 'full_key', '?')}: {reason}") from exc
    _expand_paths(config)
    validate(config)
    return config


def to_yaml(config: SpecTrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _flat(tree: dict, prefix: str = "") -> dict:
    flat: dict = {}
    for name, value in tree.items():
        flat.update(_flat(value, f"{prefix}{name}.") if isinstance(value, dict) else {f"{prefix}{name}": value})
    return flat


def describe_differences(before: dict, now: dict) -> str:
    """`key: A before, B now` for every dotted key whose value differs, for refusal messages."""
    old, new = _flat(before), _flat(now)
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k, "(absent)") != new.get(k, "(absent)"))
    return ", ".join(f"{k}: {old.get(k, '(absent)')} before, {new.get(k, '(absent)')} now" for k in keys)

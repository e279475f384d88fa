"""Structured configs: the schema (`schema.py`), recipe loading (`loading.py`), validation (`validation.py`)."""
from spectrain.config.loading import describe_differences, load_config, packaged_recipe_dir, resolve_recipe, to_yaml
from spectrain.config.schema import DEFAULT_RECIPE, SpecTrainConfig
from spectrain.config.validation import validate
from spectrain.errors import ConfigError

__all__ = ["ConfigError", "DEFAULT_RECIPE", "SpecTrainConfig", "describe_differences", "load_config",
           "packaged_recipe_dir", "resolve_recipe", "to_yaml", "validate"]

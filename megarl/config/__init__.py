"""Typed configuration: the Hydra schema, recipe loading and validation."""
from megarl.config.errors import ConfigError
from megarl.config.load import default_config, load_config, recipes_dir
from megarl.config.schema import MegarlConfig

__all__ = ["ConfigError", "MegarlConfig", "default_config", "load_config", "recipes_dir"]

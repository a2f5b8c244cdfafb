"""Typed configuration: the Hydra schema, recipe loading and validation."""
from megarl.config.load import ConfigError, load_config, recipes_dir
from megarl.config.schema import MegarlConfig

__all__ = ["ConfigError", "MegarlConfig", "load_config", "recipes_dir"]

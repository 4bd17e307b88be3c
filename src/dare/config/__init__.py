"""Typed configuration (dataclasses + YAML + dotted overrides)."""
from .core import ConfigError, apply_overrides, from_dict, load_config, load_yaml, parse_override, to_dict

__all__ = ["ConfigError", "apply_overrides", "from_dict", "load_config", "load_yaml", "parse_override", "to_dict"]

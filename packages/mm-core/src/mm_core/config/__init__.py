"""Typed configuration: schema, YAML loading, overrides and one-line errors."""

from mm_core.config.loader import apply_overrides, load_config, parse_override, validate_config
from mm_core.config.schema import (
    DataConfig,
    DatasetParam,
    MMConfig,
    ModelConfig,
    ParallelConfig,
    ToolsConfig,
    TrainingConfig,
)

__all__ = [
    "DataConfig",
    "DatasetParam",
    "MMConfig",
    "ModelConfig",
    "ParallelConfig",
    "ToolsConfig",
    "TrainingConfig",
    "apply_overrides",
    "load_config",
    "parse_override",
    "validate_config",
]

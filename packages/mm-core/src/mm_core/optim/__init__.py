"""Optimizers (by registry name, with their hooks) and the learning-rate schedule."""

from mm_core.optim.factory import (
    BuiltOptimizer,
    OptimizerPlugin,
    build_adamw,
    build_optimizer,
    describe_optimizer,
    optimizer_plugin,
)
from mm_core.optim.scheduler import build_scheduler, lr_factor

__all__ = [
    "BuiltOptimizer",
    "OptimizerPlugin",
    "build_adamw",
    "build_optimizer",
    "build_scheduler",
    "describe_optimizer",
    "lr_factor",
    "optimizer_plugin",
]

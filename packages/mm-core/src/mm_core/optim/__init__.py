"""Optimizers (by registry name) and the learning-rate schedule."""

from mm_core.optim.factory import build_adamw, build_optimizer
from mm_core.optim.scheduler import build_scheduler, lr_factor

__all__ = ["build_adamw", "build_optimizer", "build_scheduler", "lr_factor"]

"""Learning-rate schedule: linear warmup (``lr_warmup_ratio``), then constant, linear or cosine decay
to ``lr_min``."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from mm_core.config.schema import TrainingConfig


def lr_factor(step: int, cfg: TrainingConfig) -> float:
    """Multiplier of the base lr for optimizer step ``step`` (0-based)."""
    total = cfg.total_iters
    warmup = math.ceil(cfg.lr_warmup_ratio * total)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_decay_style == "constant" or cfg.lr <= 0:
        return 1.0
    floor = cfg.lr_min / cfg.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if cfg.lr_decay_style == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig) -> LambdaLR:
    """A LambdaLR (its state is saved in checkpoints) applying :func:`lr_factor` to every group."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg))

"""Optimizers registered in ``mm.optimizers``: a factory ``(model, training_cfg, plans) -> Optimizer``."""

from __future__ import annotations

import torch
from torch import nn

from mm_core.config.schema import TrainingConfig
from mm_core.registry import optimizer_register


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (and higher) take weight decay; biases, norms and other 1-D params do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_adamw(model: nn.Module, cfg: TrainingConfig, plans: dict | None = None) -> torch.optim.Optimizer:
    """AdamW with ``training.adam_*``; fused kernels on accelerators when ``training.adam_fused``."""
    device_type = next(model.parameters()).device.type
    fused = cfg.adam_fused and device_type in ("cuda", "npu")
    return torch.optim.AdamW(
        decay_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


def build_optimizer(
    model: nn.Module, cfg: TrainingConfig, plans: dict | None = None
) -> torch.optim.Optimizer:
    """Look up ``training.optimizer`` in the registry and build it."""
    factory = optimizer_register.get(cfg.optimizer)
    return factory(model, cfg, plans or {})

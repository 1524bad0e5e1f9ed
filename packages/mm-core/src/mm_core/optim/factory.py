"""Optimizers registered in ``mm.optimizers``.

An entry point names either a bare factory ``(model, training_cfg, plan: ModelPlan) -> Optimizer`` or an
:class:`OptimizerPlugin`, which wraps such a factory with optional hooks: its gradient-clipping policy, its
summary for ``mm check`` and its state size for the memory estimate. mm reads an optimizer's behaviour only
through these hooks, never through its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mm_core.config.schema import TrainingConfig
from mm_core.optim.lr_scaling import apply_lr_scaling, check_applied, resolve_lr_scaling
from mm_core.registry import optimizer_register

if TYPE_CHECKING:
    from mm_core.models.plan import ModelPlan

#: which parameters' gradients the global-norm clip scales (see :func:`mm_parallel.grad.clip_grad_norm_`)
ParamFilter = Callable[[nn.Parameter], bool]
OptimizerFactory = Callable[[nn.Module, TrainingConfig, "ModelPlan"], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerPlugin:
    """An ``mm.optimizers`` entry: a factory plus optional hooks; callable as the factory itself."""

    #: ``(model, training_cfg, plan) -> Optimizer``
    build: OptimizerFactory
    #: ``(optimizer, training_cfg) -> filter or None``: the parameters whose gradients ``training.clip_grad``
    #: scales (the norm is always over every gradient); None, or a hook returning None: all of them
    clip_policy: Callable[[torch.optim.Optimizer, TrainingConfig], ParamFilter | None] | None = None
    #: ``(model, training_cfg, plan) -> lines`` for ``mm check`` (the first follows ``optimizer   :``);
    #: None: the registry name and the trainable-parameter count
    describe: Callable[[nn.Module, TrainingConfig, ModelPlan], list[str]] | None = None
    #: fp32 state tensors kept per trainable parameter (AdamW: 2 moments), for the memory estimate
    states_per_param: float = 2.0

    def __call__(self, model: nn.Module, cfg: TrainingConfig, plan: ModelPlan) -> torch.optim.Optimizer:
        return self.build(model, cfg, plan)


@dataclass(frozen=True)
class BuiltOptimizer:
    """What the trainer gets: the optimizer and its clipping policy (None: clipping scales every gradient)."""

    optimizer: torch.optim.Optimizer
    clip_scale_only: ParamFilter | None = None


def optimizer_plugin(name: str) -> OptimizerPlugin:
    """The registered optimizer ``name`` (``training.optimizer``); a bare factory gets the default hooks."""
    obj = optimizer_register.get(name)
    return obj if isinstance(obj, OptimizerPlugin) else OptimizerPlugin(build=obj)


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: matrices (and higher) take weight decay; biases, norms and other 1-D params do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_adamw(
    model: nn.Module, cfg: TrainingConfig, plan: ModelPlan | None = None
) -> torch.optim.Optimizer:
    """AdamW with ``training.adam_*`` and ``training.lr_scaling_plan``; torch's fused kernel (cuda, npu
    and cpu; sharded DTensor parameters included) when ``training.adam_fused``, else the multi-tensor
    (foreach) one."""
    device_type = next(model.parameters()).device.type
    fused = cfg.adam_fused and device_type in ("cuda", "npu", "cpu")
    return torch.optim.AdamW(
        apply_lr_scaling(model, decay_groups(model, cfg.weight_decay), cfg),
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


def build_optimizer(model: nn.Module, cfg: TrainingConfig, plan: ModelPlan) -> BuiltOptimizer:
    """Look up ``training.optimizer`` in the registry, build it and ask for its clipping policy."""
    plugin = optimizer_plugin(cfg.optimizer)
    optimizer = plugin.build(model, cfg, plan)
    check_applied(optimizer, cfg)
    policy = plugin.clip_policy(optimizer, cfg) if plugin.clip_policy is not None else None
    return BuiltOptimizer(optimizer, policy)


def describe_optimizer(model: nn.Module, cfg: TrainingConfig, plan: ModelPlan) -> list[str]:
    """The optimizer's own summary for ``mm check`` (its ``describe`` hook), without building it."""
    plugin = optimizer_plugin(cfg.optimizer)
    if plugin.describe is not None:
        lines = plugin.describe(model, cfg, plan)
    else:
        trainable = [p for p in model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in trainable)
        lines = [f"{cfg.optimizer} over {len(trainable)} tensors ({n:,} elements)"]
    # the multipliers by pattern (training.lr_scaling_plan), checked as the worker checks them
    if cfg.lr_scaling_plan:
        lines.append("lr scaling  : training.lr_scaling_plan (first matching pattern wins)")
        lines.extend(resolve_lr_scaling(model, cfg.lr_scaling_plan).describe(cfg.lr_scaling_plan))
    return lines

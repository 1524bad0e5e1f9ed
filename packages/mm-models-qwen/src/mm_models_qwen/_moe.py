"""The meta-device init hook shared by the Qwen3.5-MoE models (``ModelPlan.init_weights``)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from mm_core.models import init_expert_adapters


@torch.no_grad()
def init_qwen3_5_moe(model: nn.Module) -> None:
    """The routers, then the expert-parallel adapters (:func:`~mm_core.models.init_expert_adapters`).

    transformers' ``init_weights()`` treats a subclass defined outside transformers as custom code and skips
    the modules without parameters of their own, so ``Qwen3_5MoeSparseMoeBlock`` (which initialises its
    router ``gate``) is passed over on meta-device init; a normal build initialises it normal(0, std)."""
    config = cast(PretrainedConfig, model.config)  # nn.Module.__getattr__ types it Tensor | Module
    std = config.get_text_config().initializer_range
    for module in model.modules():
        if isinstance(module, Qwen3_5MoeSparseMoeBlock):
            module.gate.weight.normal_(0.0, std)
    init_expert_adapters(model, std)

"""The meta-device init hooks of the Qwen mixture-of-experts models (``ModelPlan.init_weights``): the
Qwen3.5-MoE models and Qwen3-Omni-MoE's thinker."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextSparseMoeBlock

from mm_core.models import init_expert_adapters
from mm_parallel.moe import ExpertParallelExperts


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


@torch.no_grad()
def init_qwen3_omni_moe(model: nn.Module) -> None:
    """The routers and fused experts of the thinker's decoder, then the expert-parallel adapters.

    transformers initialises both in its ``_init_weights`` of the sparse block (normal(0, std), ``std`` the
    thinker config's ``initializer_range``), a module without parameters of its own, which ``init_weights()``
    skips for a subclass defined outside transformers (see :func:`init_qwen3_5_moe`)."""
    config = cast(PretrainedConfig, model.config)
    std = config.initializer_range
    for module in model.modules():
        if isinstance(module, Qwen3OmniMoeThinkerTextSparseMoeBlock):
            module.gate.weight.normal_(0.0, std)
            experts = module.experts
            if not isinstance(experts, ExpertParallelExperts):  # an adapter is initialised below
                experts.gate_up_proj.normal_(0.0, std)
                experts.down_proj.normal_(0.0, std)
    init_expert_adapters(model, std)

"""Qwen3.5-MoE (``model.model_id: qwen3_5_moe``): transformers' ``Qwen3_5MoeForConditionalGeneration`` with
mm's plans."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from transformers import Qwen3_5MoeForConditionalGeneration

from mm_core.models import ModelPlan, TransformersExperts

from ._deltanet_ulysses import use_ulysses_deltanet
from ._moe import init_qwen3_5_moe
from ._vl import QWEN_VL_PLAN, QwenVLPlans


class Qwen3_5MoeForTraining(TransformersExperts, QwenVLPlans, Qwen3_5MoeForConditionalGeneration):
    """Exactly ``Qwen3_5MoeForConditionalGeneration`` plus per-tower default plans: vision blocks and decoder
    layers (attention, router and all experts of a layer together) are FSDP units; the experts are the
    expert-parallel plan; routers never take Muon. Meta-device init also initialises the routers and the
    expert-parallel adapters (:func:`~mm_models_qwen._moe.init_qwen3_5_moe`)."""

    mm_plan: ClassVar[ModelPlan] = dataclasses.replace(
        QWEN_VL_PLAN,
        expert_modules=("model.language_model.layers.{*}.mlp.experts",),
        muon_exclude_modules=(
            "model.visual.patch_embed",
            "model.language_model.layers.{*}.mlp.gate",
            "model.language_model.layers.{*}.mlp.shared_expert_gate",
        ),
        init_weights=init_qwen3_5_moe,
        ulysses_layer_types=("linear_attention",),
        ulysses_layers=use_ulysses_deltanet,
    )

"""Qwen3-VL-MoE (``model.model_id: qwen3_vl_moe``): transformers' ``Qwen3VLMoeForConditionalGeneration`` with
mm's plans."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from transformers.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration

from mm_core.models import ModelPlan, TransformersExperts, init_expert_adapters

from ._vl import QWEN_VL_PLAN, QwenVLPlans


class Qwen3VLMoeForTraining(TransformersExperts, QwenVLPlans, Qwen3VLMoeForConditionalGeneration):
    """Exactly ``Qwen3VLMoeForConditionalGeneration`` (same weights and names; its routed experts are the
    fused 3-D ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, no shared expert) plus per-tower default
    plans: vision blocks and decoder layers (attention, router and all experts of a layer together) are FSDP
    and recompute units; the experts are the expert-parallel plan; the routers (``mlp.gate``) and the patch
    embedding never take Muon.

    Meta-device init: the routers (``Qwen3VLMoeTextTopKRouter``) hold their own weight, so transformers'
    ``init_weights()`` reaches them; the plan's hook initialises the expert-parallel adapters
    (:func:`~mm_core.models.init_expert_adapters`). With images the forward needs ``mm_token_type_ids`` for
    its 3-D positions; the ``qwen3vl`` collator of mm-data-vlm emits it."""

    mm_plan: ClassVar[ModelPlan] = dataclasses.replace(
        QWEN_VL_PLAN,
        expert_modules=("model.language_model.layers.{*}.mlp.experts",),
        muon_exclude_modules=("model.visual.patch_embed", "model.language_model.layers.{*}.mlp.gate"),
        init_weights=init_expert_adapters,
        rms_norm_classes=("Qwen3VLMoeTextRMSNorm",),
    )

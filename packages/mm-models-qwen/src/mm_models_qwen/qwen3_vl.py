"""Qwen3-VL (``model.model_id: qwen3_vl``): transformers' ``Qwen3VLForConditionalGeneration`` + mm plans."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from transformers import Qwen3VLForConditionalGeneration

from mm_core.models import ModelPlan

from ._vl import QWEN_VL_PLAN, QwenVLPlans


class Qwen3VLForTraining(QwenVLPlans, Qwen3VLForConditionalGeneration):
    """Exactly ``Qwen3VLForConditionalGeneration`` (same weights and names; exports as that class) plus
    per-tower default plans: ``model.visual.blocks.{*}`` and ``model.language_model.layers.{*}`` are FSDP
    units. Freeze the vision tower with ``model.freeze: [model.visual]`` or only the projector with
    ``[model.visual.merger, model.visual.deepstack_merger_list]``."""

    #: the language model's norms (the vision tower's are LayerNorms)
    mm_plan: ClassVar[ModelPlan] = dataclasses.replace(QWEN_VL_PLAN, rms_norm_classes=("Qwen3VLTextRMSNorm",))

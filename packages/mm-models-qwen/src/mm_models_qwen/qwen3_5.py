"""Qwen3.5 (``model.model_id: qwen3_5``): transformers' ``Qwen3_5ForConditionalGeneration`` with mm's plans.

The language model mixes gated-DeltaNet (linear attention) and full-attention layers; each layer is one FSDP
unit whatever its kind. Under Ulysses context parallelism the Gated DeltaNet layers exchange heads for the
sequence as attention does (:mod:`._deltanet_ulysses`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from transformers import Qwen3_5ForConditionalGeneration

from mm_core.models import ModelPlan

from ._deltanet_ulysses import use_ulysses_deltanet
from ._vl import QWEN_VL_PLAN, QwenVLPlans


class Qwen3_5ForTraining(QwenVLPlans, Qwen3_5ForConditionalGeneration):
    """Exactly ``Qwen3_5ForConditionalGeneration`` plus per-tower default plans (vision blocks and language
    layers as FSDP units; freeze ``model.visual`` or the projector ``model.visual.merger``)."""

    #: no ``rms_norm_classes``: Qwen3.5's norms scale by ``1 + weight`` in fp32, its DeltaNet norm is gated
    mm_plan: ClassVar[ModelPlan] = dataclasses.replace(
        QWEN_VL_PLAN, ulysses_layer_types=("linear_attention",), ulysses_layers=use_ulysses_deltanet
    )

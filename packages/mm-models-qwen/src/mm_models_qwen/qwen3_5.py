"""Qwen3.5 (``model.model_id: qwen3_5``): transformers' ``Qwen3_5ForConditionalGeneration`` with mm's plans.

The language model mixes gated-DeltaNet (linear attention) and full-attention layers; each layer is one FSDP
unit whatever its kind."""

from __future__ import annotations

from transformers import Qwen3_5ForConditionalGeneration

from ._vl import QwenVLPlans


class Qwen3_5ForTraining(QwenVLPlans, Qwen3_5ForConditionalGeneration):
    """Exactly ``Qwen3_5ForConditionalGeneration`` plus per-tower default plans (vision blocks and language
    layers as FSDP units; freeze ``model.visual`` or the projector ``model.visual.merger``)."""

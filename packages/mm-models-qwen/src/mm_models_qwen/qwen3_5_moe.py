"""Qwen3.5-MoE (``model.model_id: qwen3_5_moe``): transformers' ``Qwen3_5MoeForConditionalGeneration`` with
mm's plans."""

from __future__ import annotations

from typing import ClassVar

from transformers import Qwen3_5MoeForConditionalGeneration

from ._vl import QwenVLPlans


class Qwen3_5MoeForTraining(QwenVLPlans, Qwen3_5MoeForConditionalGeneration):
    """Exactly ``Qwen3_5MoeForConditionalGeneration`` plus per-tower default plans: vision blocks and decoder
    layers (attention, router and all experts of a layer together) are FSDP units; the experts are the
    expert-parallel plan; routers never take Muon."""

    mm_ep_modules: ClassVar[list[str]] = ["model.language_model.layers.{*}.mlp.experts"]
    mm_muon_exclude_modules: ClassVar[list[str]] = [
        "model.visual.patch_embed",
        "model.language_model.layers.{*}.mlp.gate",
        "model.language_model.layers.{*}.mlp.shared_expert_gate",
    ]

"""Qwen3-MoE (``model.model_id: qwen3_moe``): transformers' ``Qwen3MoeForCausalLM`` with mm's plans."""

from __future__ import annotations

from typing import ClassVar

from transformers import Qwen3MoeForCausalLM

from mm_core.models import ModelPlan, TransformersExperts, init_expert_adapters


class Qwen3MoeForTraining(TransformersExperts, Qwen3MoeForCausalLM):
    """Exactly ``Qwen3MoeForCausalLM`` (same weights and names; its experts are the fused 3-D
    ``gate_up_proj``/``down_proj``), plus mm's default plans: each decoder layer is one FSDP unit and one
    recompute unit, the fused experts of every MoE layer are expert-parallel when
    ``parallel.expert_parallel_size > 1``, and the routers stay out of Muon. Meta-device init also
    initialises the expert-parallel adapters (:func:`~mm_core.models.init_expert_adapters`)."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("model.layers.{*}",),
        recompute_units=("model.layers.{*}",),
        expert_modules=("model.layers.{*}.mlp.experts",),
        muon_exclude_modules=("model.layers.{*}.mlp.gate",),
        output_head="lm_head",
        input_embedding="model.embed_tokens",
        output_norm="model.norm",
        init_weights=init_expert_adapters,
        rms_norm_classes=("Qwen3MoeRMSNorm",),
    )

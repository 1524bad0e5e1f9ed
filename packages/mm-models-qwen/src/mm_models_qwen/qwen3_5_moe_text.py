"""The language model of Qwen3.5-MoE (``model.model_id: qwen3_5_moe_text``): transformers'
``Qwen3_5MoeForCausalLM`` (config ``Qwen3_5MoeTextConfig``; hybrid linear/full attention, routed experts with
fused 3-D weights plus a gated shared expert) with mm's default plans."""

from __future__ import annotations

from typing import ClassVar

from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

from mm_core.models import ModelPlan, TransformersExperts

from ._deltanet_ulysses import use_ulysses_deltanet
from ._moe import init_qwen3_5_moe


class Qwen3_5MoeTextForTraining(TransformersExperts, Qwen3_5MoeForCausalLM):
    """Exactly ``Qwen3_5MoeForCausalLM`` plus mm's default plans: each decoder layer is one FSDP unit and one
    recompute unit; the routed experts (``mlp.experts``) are expert-parallel when
    ``parallel.expert_parallel_size > 1`` while the shared expert stays data-parallel; the router and the
    shared-expert gate stay out of Muon. Meta-device init also initialises the routers and the expert-parallel
    adapters (:func:`~mm_models_qwen._moe.init_qwen3_5_moe`)."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("model.layers.{*}",),
        recompute_units=("model.layers.{*}",),
        expert_modules=("model.layers.{*}.mlp.experts",),
        muon_exclude_modules=("model.layers.{*}.mlp.gate", "model.layers.{*}.mlp.shared_expert_gate"),
        output_head="lm_head",
        input_embedding="model.embed_tokens",
        output_norm="model.norm",
        init_weights=init_qwen3_5_moe,
        ulysses_layer_types=("linear_attention",),
        ulysses_layers=use_ulysses_deltanet,
    )

"""The language model of Qwen3.5-MoE (``model.model_id: qwen3_5_moe_text``): transformers'
``Qwen3_5MoeForCausalLM`` (config ``Qwen3_5MoeTextConfig``; hybrid linear/full attention, routed experts with
fused 3-D weights plus a gated shared expert) with mm's default plans."""

from __future__ import annotations

from typing import ClassVar

from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

from mm_core.models import ModelPlans
from mm_parallel.moe import ExpertParallelExperts


class Qwen3_5MoeTextForTraining(Qwen3_5MoeForCausalLM, ModelPlans):
    """Exactly ``Qwen3_5MoeForCausalLM`` plus mm's default plans: each decoder layer is one FSDP unit and one
    recompute unit; the routed experts (``mlp.experts``) are expert-parallel when
    ``parallel.expert_parallel_size > 1`` while the shared expert stays data-parallel; the router and the
    shared-expert gate stay out of Muon."""

    mm_fsdp_modules: ClassVar[list[str]] = ["model.layers.{*}"]
    mm_recompute_modules: ClassVar[list[str]] = ["model.layers.{*}"]
    mm_ep_modules: ClassVar[list[str]] = ["model.layers.{*}.mlp.experts"]
    mm_muon_exclude_modules: ClassVar[list[str]] = [
        "model.layers.{*}.mlp.gate",
        "model.layers.{*}.mlp.shared_expert_gate",
    ]

    def initialize_weights(self) -> None:
        """transformers' initialisation, plus the expert-parallel adapters (which live inside the base model,
        whose own ``_init_weights`` does not know them): used by meta-device init."""
        super().initialize_weights()
        for module in self.modules():
            if isinstance(module, ExpertParallelExperts):
                module.reset_parameters(self.config.initializer_range)
